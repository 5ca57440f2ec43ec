"""Control-plane server and client: every call and every reply proves it knows
the job token without sending it (proof.py), and a client's first call to a
server is Hello, so no other request reaches a server until it has proved the
token; optional TLS, a bounded share of threads for calls that wait; errors
cross as in `status.py`."""
from __future__ import annotations

import collections
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc

from ..errors import AuthenticationError, TransportError
from . import control_pb2 as pb
from . import control_pb2_grpc as pb_grpc
from .proof import UNBOUND, Signer, Verifier, answer, check_answer, digest
from .status import rpc_error

PROOF_KEY = "rdmatensor-proof"
ANSWER_KEY = "rdmatensor-answer"      # a reply's proof, in its trailing metadata
HELLO = "/rdmatensor.control.Control/Hello"
# The grpc baseline's Push carries a whole tensor: hashing it would slow the baseline
# being measured. Its proof binds the method and the call, not the payload.
UNBOUND_METHODS = frozenset({"/rdmatensor.control.Baseline/Push"})
MAX_MESSAGE = 1 << 30          # the grpc baseline carries whole tensors
STOP_WAIT = 2.0                # seconds a stopping server gets beyond the calls' grace


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes: this side's certificate chain and key, and the CA that signs its peers'."""
    cert_chain: bytes
    private_key: bytes
    root_ca: bytes
    server_name: str | None = None   # override the name checked in peers' certificates


# Calls that wait for other ranks (a barrier holds its server thread until every
# rank arrived). They get a bounded share of the server's threads, so a flood of
# them can neither starve Exchange, Grow, Bye and Push nor grow without bound.
BLOCKING_METHODS = frozenset({"/rdmatensor.control.Control/Barrier"})
WORKERS = 512                  # threads start on demand; the coordinator of an N-rank
RESERVED_WORKERS = 32          # barrier holds N - 1, the rest are kept for other calls


def _refusal(message: str):
    """A handler that refuses the call with `message`, reading no request."""
    def deny(requests, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return grpc.stream_unary_rpc_method_handler(deny)


class _ProofCheck(grpc.ServerInterceptor):
    """Refuse any call that does not prove it knows the session token (proof.py):
    a peer without it never reaches a handler, so it never learns a descriptor.
    The refusal reads no request (a stream handler that never iterates), so an
    unauthenticated caller cannot make the server buffer a message of up to
    MAX_MESSAGE bytes; the body a proof binds is checked as it is read. Blocking
    calls beyond their share of threads are refused at once."""

    def __init__(self, token: str, blocking_limit: int):
        self._token, self._verifier = token, Verifier(token)
        self._blocking = threading.BoundedSemaphore(max(1, blocking_limit))
        self._wrapped: dict = {}

        self._deny = _refusal("wrong or missing rdmatensor token")
        # Hello is answered here, for every servicer: its reply's proof is all it is for
        self._hello = grpc.unary_unary_rpc_method_handler(lambda request, context: pb.HelloReply(),
                                                          request_deserializer=pb.HelloRequest.FromString,
                                                          response_serializer=pb.HelloReply.SerializeToString)

    def intercept_service(self, continuation, details):
        proofs = [v for k, v in details.invocation_metadata or () if k == PROOF_KEY and isinstance(v, str)]
        if len(proofs) != 1:
            return self._deny
        try:
            bound = self._verifier.check(details.method, proofs[0])
        except AuthenticationError as exc:      # why, when the token was right: a clock off, a replay
            return _refusal(str(exc))
        if bound == UNBOUND and details.method not in UNBOUND_METHODS:
            return self._deny
        handler = self._hello if details.method == HELLO else continuation(details)
        if handler is None or not handler.unary_unary:
            return handler
        inner, parse = handler.unary_unary, handler.request_deserializer
        if details.method in BLOCKING_METHODS:
            inner = self._bounded(details.method, inner)
        if bound != UNBOUND:
            def parse_bound(raw: bytes, parse=parse, bound=bound):
                if digest(raw) != bound:
                    raise AuthenticationError("the call's body is not the one its proof was made for")
                return parse(raw)
            parse = parse_bound
        serialize, token, proof = handler.response_serializer, self._token, proofs[0]

        def answered(request, context, inner=inner):
            reply = inner(request, context)
            raw = reply if serialize is None else serialize(reply)
            context.set_trailing_metadata(((ANSWER_KEY, answer(token, proof, digest(raw))),))
            return raw
        return grpc.unary_unary_rpc_method_handler(answered, request_deserializer=parse)

    def _bounded(self, method: str, inner):
        def call(request, context):
            if not self._blocking.acquire(blocking=False):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many {method.rsplit('/', 1)[-1]} calls waiting")
            try:
                return inner(request, context)
            finally:
                self._blocking.release()
        return call


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _Prove(grpc.UnaryUnaryClientInterceptor):
    """Every call of a client carries its proof, over its body unless the method is unbound;
    its reply is given only once it proved the token for this call."""

    def __init__(self, token: str):
        self._token, self._signer = token, Signer(token)

    def intercept_unary_unary(self, continuation, details, request):
        body = request if isinstance(request, bytes) else request.SerializeToString()    # a raw stub's bytes
        bound = UNBOUND if details.method in UNBOUND_METHODS else digest(body)
        proof = self._signer.sign(details.method, bound)
        metadata = list(details.metadata or ()) + [(PROOF_KEY, proof)]
        outcome = continuation(_Details(details.method, details.timeout, metadata, details.credentials,
                                        details.wait_for_ready, getattr(details, "compression", None)), request)
        return _Answered(outcome, self._token, proof)


class _Answered:
    """A call's outcome (a grpc Call and Future) whose result() checks the reply's proof first."""

    def __init__(self, outcome, token: str, proof: str):
        self._outcome, self._token, self._proof = outcome, token, proof

    def result(self, timeout=None):
        reply = self._outcome.result(timeout)
        raw = reply if isinstance(reply, bytes) else reply.SerializeToString()
        given = dict(self._outcome.trailing_metadata() or ()).get(ANSWER_KEY)
        check_answer(self._token, self._proof, digest(raw), given)
        return reply

    def __getattr__(self, name):
        return getattr(self._outcome, name)


_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
            # A peer still starting up is retried quickly, not after gRPC's 1 s default.
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 500),
            # No transparent retries: a call to a server shutting down (a peer whose
            # setup failed) was retried in a tight loop, holding every attempt's error.
            ("grpc.enable_retries", 0)]


def start_server(address: str, token: str, control, baseline, tls: TlsConfig | None = None,
                 workers: int | None = None) -> tuple["ControlServer", int]:
    """Serve `control` (a ControlServicer) and `baseline` on `address` ("host:port", port 0 picks one)."""
    workers = WORKERS if workers is None else workers
    check = _ProofCheck(token, blocking_limit=workers - min(RESERVED_WORKERS, workers // 2))
    executor = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rdmatensor-ctl")
    server = grpc.server(executor, interceptors=[check], options=_OPTIONS)
    try:
        pb_grpc.add_ControlServicer_to_server(control, server)
        pb_grpc.add_BaselineServicer_to_server(baseline, server)
        if tls:
            creds = grpc.ssl_server_credentials([(tls.private_key, tls.cert_chain)],
                                                root_certificates=tls.root_ca, require_client_auth=True)
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:    # grpc raises RuntimeError when it cannot bind
        port, error = 0, exc
    else:
        error = None
    if port == 0:
        server.stop(None)
        executor.shutdown(wait=False)
        raise TransportError(f"cannot listen for the control plane on {address}"
                             + (f": {error}" if error else ""))
    server.start()
    return ControlServer(server, executor), port


class ControlServer:
    """A running control server. stop() also ends its worker threads and lets
    go of the gRPC server, so a stopped server holds no thread and no file
    descriptor even while its owner (a closed Session) is still referenced."""

    def __init__(self, server: grpc.Server, executor: futures.ThreadPoolExecutor):
        self._server, self._executor = server, executor
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop serving (calls in progress get `grace` seconds); returns an Event
        that is set once the server is down. Idempotent."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            # Bounded: a server whose serving thread is gone (a call that came after
            # the interpreter began to exit) never reports that it stopped.
            server.stop(grace).wait(STOP_WAIT + (grace or 0.0))
            # Workers still inside a handler (a barrier's wait) finish on their own.
            self._executor.shutdown(wait=False)
            self._stopped.set()
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)


def proving(channel: grpc.Channel, token: str) -> grpc.Channel:
    """`channel` with every unary call proving `token` (ControlClient's calls already do)."""
    return grpc.intercept_channel(channel, _Prove(token))


ABORT_POLL = 0.2      # seconds between looks at a call's abort hook


class ControlClient:
    """Stubs to one peer's control server; every call proves the token (the token itself never travels)."""

    def __init__(self, address: str, token: str, tls: TlsConfig | None = None, peer: int | None = None):
        self.address, self.peer = address, peer
        if tls:
            creds = grpc.ssl_channel_credentials(tls.root_ca, tls.private_key, tls.cert_chain)
            opts = _OPTIONS + ([("grpc.ssl_target_name_override", tls.server_name)]
                               if tls.server_name else [])
            self.raw_channel = grpc.secure_channel(address, creds, options=opts)
        else:
            self.raw_channel = grpc.insecure_channel(address, options=_OPTIONS)
        self.channel = proving(self.raw_channel, token)
        self.metadata = ()
        self.calls = 0
        self._proven = False          # Hello answered: this server proved the token
        self.control = pb_grpc.ControlStub(self.channel)
        self.baseline = pb_grpc.BaselineStub(self.channel)

    def call(self, method, request, timeout: float, wait_for_ready: bool = False, abort=None):
        """`abort()`, if given, is called every ABORT_POLL seconds while the
        call waits; what it raises cancels the call and is raised. The first
        call is preceded by Hello: its request's body (descriptors, keys) goes
        only to a server whose reply proved the token."""
        if not self._proven:
            self._call(self.control.Hello, pb.HelloRequest(), timeout, wait_for_ready, abort)
            self._proven = True
        return self._call(method, request, timeout, wait_for_ready, abort)

    def _call(self, method, request, timeout: float, wait_for_ready: bool, abort):
        self.calls += 1
        try:
            if abort is None:
                return method(request, timeout=timeout, metadata=self.metadata, wait_for_ready=wait_for_ready)
            future = method.future(request, timeout=timeout, metadata=self.metadata, wait_for_ready=wait_for_ready)
            while True:
                try:
                    return future.result(timeout=ABORT_POLL)
                except grpc.FutureTimeoutError:
                    try:
                        abort()
                    except BaseException:
                        future.cancel()
                        raise
        except grpc.RpcError as exc:
            raise rpc_error(exc, self.address, self.peer) from None
        except AuthenticationError as exc:
            who = f"rank {self.peer} at {self.address}" if self.peer is not None else self.address
            raise AuthenticationError(f"{who}: {exc}", peer=self.peer) from None

    def close(self) -> None:
        self.raw_channel.close()


__all__ = ["pb", "pb_grpc", "start_server", "ControlServer", "ControlClient", "TlsConfig", "rpc_error", "proving"]
