"""Everything a scheduler process is started with, whatever its role (all-in-one, planner or
front-end): each role reads the fields it uses."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from scheduler_service.core.sampling_params import SamplingDefaults
from scheduler_service.core.tenants import TenantTable
from scheduler_service.frontend.intake_limits import IntakeLimits
from scheduler_service.frontend.tracing import NO_TRACING, Tracing
from scheduler_service.planner.discovery import DEFAULT_RESOLVE_INTERVAL_S
from scheduler_service.planner.engine_options import EngineOptions
from scheduler_service.text.tokenizer import TextProcessor
from service_support.transport_security import ClientTls, ServerTls

# Under Kubernetes' default 30 s termination grace, with room to stop after the drain.
DEFAULT_DRAIN_TIMEOUT_S = 25.0


@dataclass(slots=True, frozen=True)
class ServerSettings:
    host: str
    port: int
    # HOST:PORT or dns:///NAME:PORT, one or more.
    executors: tuple[str, ...]
    options: EngineOptions
    text: TextProcessor | None = None
    metrics_port: int | None = None
    # Presented to executors on Execute; default HOSTNAME:PORT (the bound port).
    scheduler_id: str | None = None
    resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S
    limits: IntakeLimits = field(default_factory=IntakeLimits)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # TLS on the client API.
    tls: ServerTls | None = None
    # Bearer tokens a client must present, each with its tenant (frontend/api_keys.py
    # load_key_tenants; None: no token needed).
    api_keys: Mapping[bytes, str] | None = None
    # Bearer tokens the Admin service takes instead (None: Admin is closed if api_keys are set).
    admin_keys: tuple[bytes, ...] | None = None
    # TLS to the executors (mutual when it holds a certificate).
    executor_tls: ClientTls | None = None
    # The executors' shared token (--executor-token-file), sent on every Executor API call.
    executor_token: str | None = None
    # Plaintext grpc.health.v1-only port for probes.
    health_port: int | None = None
    # On SIGTERM, seconds the requests in flight get to finish before they are aborted.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # Where spans go (frontend/tracing.py); NO_TRACING keeps tracing off and free.
    tracing: Tracing = NO_TRACING
    # Where the step trace goes (planner/step_trace.py); None keeps it off.
    trace_dir: Path | None = None
    # Tenants' weights and quotas (--tenants-file; core/tenants.py).
    tenants: TenantTable = field(default_factory=TenantTable)
