"""rdmatensor-run's elastic mode: workers that come and go, a job that goes on.

    rdmatensor-run [-np N] --min-np MIN --max-np MAX --host-discovery-script SCRIPT
                   [--elastic-timeout S] [--discovery-interval S] CMD [ARGS ...]

As horovodrun's: SCRIPT prints the hosts that may run workers now, one
`host:slots` per line (`host` alone is one slot). The launcher keeps as many
workers running as the hosts offer slots, at most MAX, starting N (default:
what the script offers) at first. A worker that dies is not the job's end:
the others see the loss, roll back to their last commit and form the job
again without it (tf_plugin.elastic.run); when the script offers slots that
no worker uses, new workers start there and join at the next commit. Unlike
horovodrun, a host whose worker failed is not blacklisted: a slot the script
still offers gets a new worker; a host no longer listed has its workers
stopped, one listed with fewer slots keeps the workers it runs. A script that
lists no host at all is taken as a failed read (a hosts file caught between
truncation and write reads empty): the workers are kept, and the job ends
only once nothing has been offered for --elastic-timeout.

Every worker gets RDMATENSOR_RENDEZVOUS (this launcher's rendezvous server,
see rendezvous.py) and RDMATENSOR_WORKER_ID, and no TF_CONFIG: its rank and
its peers come from the round it joins. Its output lines are prefixed with its
worker id ([id]), which is its first rank. The job succeeds when its workers
finish with status 0. It fails, saying why in one line, when fewer than MIN
workers are left for S seconds (--elastic-timeout, 600 by default as in
horovodrun), or when every worker failed.
"""
from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from typing import Sequence

from .addresses import AddressError, address_for, host_port, named_address
from .placement import LaunchError, Placement, is_local
from .processes import TIMEOUT_STATUS, Job, describe, local_env, stop_on_signals
from .rendezvous_server import Rounds, Server

DISCOVERY_TIMEOUT = 30.0


def parse_discovery(text: str, default_slots: int = 1) -> list[tuple[str, int]]:
    """`host:slots` lines (blank lines and #-comments skipped) -> [(host, slots)]; a bare
    `host` has `default_slots` (horovodrun's --slots-per-host)."""
    hosts = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.rpartition(":") if ":" in line else (line, "", str(default_slots))
        try:
            count = int(slots)
        except ValueError:
            raise LaunchError(f"host discovery: {line!r} is not host:slots") from None
        if not host or count < 0:
            raise LaunchError(f"host discovery: {line!r} is not host:slots")
        hosts.append((host, count))
    return hosts


def discover(script: str, default_slots: int = 1) -> list[tuple[str, int]]:
    proc = subprocess.run([script], capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT)
    if proc.returncode != 0:
        raise LaunchError(f"host discovery script {script} exited with status {proc.returncode}: "
                          f"{proc.stderr.strip()[-300:]}")
    return parse_discovery(proc.stdout, default_slots)


class ElasticJob(Job):
    """Workers started and lost over the job's life, one rendezvous for all."""

    def __init__(self, command: Sequence[str], script: str, min_np: int, max_np: int, np: int | None = None,
                 elastic_timeout: float = 600.0, discovery_interval: float = 1.0, reset_limit: int | None = None,
                 slots_per_host: int = 1, **kwargs):
        super().__init__([], command, **kwargs)
        self.slots_per_host = slots_per_host      # slots of a discovered host written without :N
        if not 1 <= min_np <= max_np:
            raise LaunchError(f"--min-np {min_np} --max-np {max_np}: need 1 <= min-np <= max-np")
        self.script, self.min_np, self.max_np, self.np = script, min_np, max_np, np
        self.elastic_timeout, self.discovery_interval = elastic_timeout, discovery_interval
        self.reset_limit = reset_limit      # re-formations allowed after the first round (None: any)
        self.rounds = Rounds(self._alive_ids, min_np)
        # the launcher gives up first, and says why in one line
        self.server = Server(self.rounds, self.token, join_timeout=elastic_timeout + 30.0)
        self.next_id = 0
        self.finishing = False          # a worker ended with 0: training is over, start no other
        self.short_since: float | None = None
        self.nothing_since: float | None = None     # since when discovery offers no slot at all
        # Slots not refilled: a worker failed there before any round it was in committed. A new
        # one would fail the same way (a script that fails to start, or that runs a collective
        # before hvd.elastic.run, which a joiner cannot). Refilled once the offered hosts change.
        self.barred: Counter = Counter()
        self.reported: set[int] = set()  # workers whose end was handled (until then they hold their slot)
        self._offered: list | None = None

    def most_ranks(self) -> int:
        return self.max_np

    def _alive_ids(self) -> list[int]:
        return [p.rank for p, proc in self.started if proc.returncode is None and proc.poll() is None]

    def _rendezvous_address(self, p: Placement) -> str:
        """This launcher's server as worker `p` reaches it (addresses.py)."""
        here = "127.0.0.1" if p.local else address_for(p.host, self.network_interfaces)
        return host_port(here, self.server.port)

    def start_worker(self, host: str) -> bool:
        """Start a worker on `host`; False (said in one line) when this host has no address it reaches."""
        wid, local = self.next_id, is_local(host)
        p = Placement(wid, "worker", wid, host, "", 0, 1, local)
        try:
            rendezvous = self._rendezvous_address(p)
        except AddressError as exc:
            self.say(f"no worker on {host}: {exc}; it is not tried again while the discovery script offers "
                     "the same hosts")
            return False
        self.next_id += 1
        address_host = "127.0.0.1" if local else host
        env = {"RDMATENSOR_TOKEN": self.token, "RDMATENSOR_JOB": self.job, "PYTHONUNBUFFERED": "1",
               "RDMATENSOR_RENDEZVOUS": rendezvous, "RDMATENSOR_WORKER_ID": str(wid),
               "RDMATENSOR_HOST": address_host, "RDMATENSOR_ELASTIC_TIMEOUT": f"{self.elastic_timeout:g}"}
        if self.provider:
            env["RDMATENSOR_PROVIDER"] = self.provider
        if local:
            argv, penv = list(self.command), {k: v for k, v in local_env(env).items() if k != "TF_CONFIG"}
        else:
            env.update({k: os.environ[k] for k in self.forward if k in os.environ})
            argv, penv = self.remote_argv(host, env), None
        proc = self.spawn(argv, penv, local)
        self.started.append((p, proc))
        readers = self.readers_of(wid, proc)
        for r in readers:
            r.start()
        self.readers += readers
        self.rounds.changed()
        return True

    def _scale(self, offered: list[tuple[str, int]]) -> None:
        """Start workers on slots the hosts offer and no live worker uses (at most max-np);
        stop those on hosts no longer offered. A listed host offering fewer slots than it
        runs workers keeps them (one may be dying already): it only gets no new one."""
        if offered != self._offered:
            self._offered, self.barred = offered, Counter()
        slots = Counter()
        for host, count in offered:
            slots[host] += count
        hosts = {h for h, c in slots.items() if c > 0}
        slots.subtract(self.barred)
        live = [(p, proc) for p, proc in self.started if p.rank not in self.reported]
        for p, proc in live:
            if p.host not in hosts:
                self.say(f"worker {p.rank} on {p.host}: the host is no longer offered, stopping it")
                proc.terminate()
            slots[p.host] -= 1
        budget = 0 if self.finishing else self.max_np - len(live)
        if not self.started and self.np is not None:
            budget = min(budget, self.np)
        for host, free in slots.items():
            started = 0
            for _ in range(max(0, min(free, budget))):
                if not self.start_worker(host):
                    self.barred[host] += free           # until the offered hosts change
                    break
                started += 1
            budget -= started

    def run(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        status, last_discovery, reported = 1, 0.0, self.reported
        try:
            while True:
                ended = False
                for p, proc in self.started:
                    code = proc.poll()
                    if code is not None and p.rank not in reported:
                        reported.add(p.rank)
                        ended = True
                        if code == 0:
                            self.finishing = True
                        else:
                            left = len(self._alive_ids())
                            barred = not self.finishing and p.rank not in self.rounds.established
                            if barred:
                                self.barred[p.host] += 1
                            self.say(f"worker {p.rank} on {p.host} {describe(code, not is_local(p.host))}"
                                     + (" before any commit of a round it was in: its slot is not refilled "
                                        "while the discovery script offers the same hosts" if barred else "")
                                     + f"; {left} worker(s) go on" + ("" if self.finishing else
                                                                      ", the job forms again without it"))
                if ended:
                    self.rounds.changed()
                now = time.monotonic()      # ends first: whether a slot is refilled depends on them
                if now - last_discovery >= self.discovery_interval and not self.finishing:
                    last_discovery = now
                    try:
                        offered = discover(self.script, self.slots_per_host)
                    except (LaunchError, OSError, subprocess.TimeoutExpired) as exc:
                        self.say(f"host discovery failed, keeping the workers as they are: {exc}")
                    else:
                        if self._nothing_offered(offered, now):
                            self._end(f"host discovery offered no slots for {self.elastic_timeout:g} s "
                                      f"(--elastic-timeout): the job cannot go on")
                            status = 1
                            break
                alive = self._alive_ids()
                members = self._last_members()
                if self.finishing and alive and not members & set(alive):
                    why = "the job finished"
                    self.rounds.close(why)
                    self.stop(f"{why}: workers {sorted(alive)} never joined it")   # started too late
                    continue
                if not alive and self.started:
                    status = 0 if self.finishing and self._finished_cleanly() else 1
                    break
                if not self.finishing and len(alive) < self.min_np:
                    self.short_since = self.short_since or now
                    if now - self.short_since > self.elastic_timeout:
                        self._end(f"{len(alive)} worker(s) left, fewer than --min-np {self.min_np}, for "
                                  f"{self.elastic_timeout:g} s (--elastic-timeout): the job cannot go on")
                        status = 1
                        break
                else:
                    self.short_since = None
                if self.reset_limit is not None and self.rounds.resets > self.reset_limit:
                    self._end(f"the job's reset {self.rounds.resets} (workers lost or added) is more than "
                              f"--reset-limit {self.reset_limit} allows: stopping it, as horovodrun does")
                    status = 1
                    break
                if self.stop_request:
                    why, status = self.stop_request
                    self._end(why)
                    break
                if deadline is not None and now > deadline:
                    status = TIMEOUT_STATUS
                    self._end(f"the job did not finish within its {timeout:g} s timeout (--timeout)")
                    break
                time.sleep(0.05)
        finally:
            self.server.close()
            self.cleanup()
        return status

    def _end(self, why: str) -> None:
        """Close the rendezvous and stop every worker, saying why in one line."""
        self.rounds.close(why)
        self.stop(why)

    def _nothing_offered(self, offered: list[tuple[str, int]], now: float) -> bool:
        """Scale to what discovery offers, unless it offers no slot at all: a script
        that `cat`s a hosts file being rewritten reads it empty between truncation
        and write, and stopping every worker for it ended jobs (or started them
        over). No slot is taken as a failed read, the workers kept, until it has
        lasted --elastic-timeout: then True (the job is to end)."""
        if any(count > 0 for _, count in offered):
            self.nothing_since = None
            self._scale(offered)
            return False
        if self.nothing_since is None:
            self.nothing_since = now
            self.say("host discovery offered no slots: keeping the workers as they are (a hosts file read while "
                     "being rewritten reads empty: write it to a new file and rename that over it)")
        return now - self.nothing_since > self.elastic_timeout

    def _last_members(self) -> set[int]:
        r = self.rounds.current
        return set(r.members) if r else set()

    def _finished_cleanly(self) -> bool:
        """Every member of the last round ended with status 0."""
        members = self._last_members()
        return bool(members) and all(proc.returncode == 0 for p, proc in self.started if p.rank in members)


def launch_elastic(command: Sequence[str], script: str, min_np: int, max_np: int, np: int | None = None,
                   provider: str | None = None, timeout: float | None = None, elastic_timeout: float = 600.0,
                   discovery_interval: float = 1.0, reset_limit: int | None = None,
                   ssh_identity_file: str | None = None, network_interfaces: Sequence[str] | None = None,
                   slots_per_host: int = 1, **kwargs) -> int:
    """Run `command` as an elastic job; its exit status. kwargs: Job's (grace, forward, ssh_port, ...)."""
    if network_interfaces:
        try:
            named_address(network_interfaces)       # a bad name is refused before any worker starts
        except AddressError as exc:
            raise LaunchError(str(exc)) from None
    job = ElasticJob(command, script, min_np, max_np, np, elastic_timeout, discovery_interval, reset_limit,
                     slots_per_host, provider=provider, ssh_identity_file=ssh_identity_file,
                     network_interfaces=network_interfaces, **kwargs)
    with stop_on_signals(job):
        return job.run(timeout)
