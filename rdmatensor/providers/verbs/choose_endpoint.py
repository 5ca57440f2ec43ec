"""Which RC endpoint a verbs channel opens: the compiled one where it is built,
else pyverbs; `RDMATENSOR_VERBS_ENDPOINT=native|pyverbs` forces one."""
from __future__ import annotations

from ... import environment
from ...errors import ProviderUnavailable
from . import native_endpoint

ENDPOINT_ENV = "RDMATENSOR_VERBS_ENDPOINT"
ENDPOINTS = ("native", "pyverbs")


def endpoint_kind(asked: str | None = None) -> str:
    """The endpoint to open: `asked`, else the environment's, else native when built."""
    asked = asked or environment.get(ENDPOINT_ENV, "")
    if asked and asked not in ENDPOINTS:
        raise ProviderUnavailable(f"{ENDPOINT_ENV}={asked!r}: choose {' or '.join(ENDPOINTS)}")
    if asked:
        return asked
    return "native" if native_endpoint.BUILD_ERROR is None else "pyverbs"


def endpoint_class(asked: str | None = None) -> type:
    """The endpoint class, or ProviderUnavailable saying why it cannot be used here."""
    kind = endpoint_kind(asked)
    if kind == "native":
        if native_endpoint.BUILD_ERROR is not None:
            raise ProviderUnavailable(f"the compiled verbs endpoint is not built ({native_endpoint.BUILD_ERROR}): "
                                      f"run `make setup` (it needs libibverbs-dev), or set {ENDPOINT_ENV}=pyverbs")
        return native_endpoint.NativeEndpoint
    try:
        from .pyverbs_endpoint import RcEndpoint
    except Exception as exc:  # noqa: BLE001 - pyverbs missing or broken
        raise ProviderUnavailable(f"the pyverbs endpoint cannot load: {exc}") from exc
    return RcEndpoint
