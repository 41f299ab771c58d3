"""A scheduler with tenants over a simulated executor, for the client-side tests of tenants and
deadlines: `python -m bench.sim_executor` (a fixed step time, no model, so a step-cost forecast
is steady) behind a real scheduler under --policy fair with a --tenants-file and a metrics port.

    with start_tenant_stack(folder, TENANTS) as stack:
        Client(stack.scheduler, tenant="acme")...
        scrape(stack.metrics_port)

The scheduler's tokenizer is GPT-2's with a plain-text chat template, so English prompts and
chats become ids inside the simulated executor's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import free_port
from tests.helpers.sim_executor_process import start_sim_executor
from tests.helpers.tokenizer_assets import gpt2_tokenizer_dir

STEP_MS = 20
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(slots=True, frozen=True)
class TenantStack:
    scheduler: str
    metrics_port: int
    scheduler_process: SchedulerProcess


def chat_tokenizer_dir(target: Path) -> Path:
    """GPT-2's tokenizer with a chat template that writes each turn as `role: content`."""
    folder = gpt2_tokenizer_dir(target)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


@contextmanager
def start_tenant_stack(folder: Path, tenants: str, **scheduler_flags: object) -> Iterator[TenantStack]:
    """tenants: the --tenants-file's TOML text; scheduler_flags: more of its flags."""
    tenants_file = folder / "tenants.toml"
    tenants_file.write_text(tenants)
    tokenizer = chat_tokenizer_dir(folder / "tokenizer")
    with ExitStack() as stack:
        executor_address = stack.enter_context(start_sim_executor(STEP_MS))
        metrics_port = free_port()
        scheduler = SchedulerProcess(
            executor_address,
            tokenizer=tokenizer,
            policy="fair",
            tenants_file=tenants_file,
            metrics_port=metrics_port,
            **scheduler_flags,
        )
        stack.callback(scheduler.close)
        yield TenantStack(scheduler.wait_ready(timeout_s=120.0), metrics_port, scheduler)


def tenants_report(address: str) -> dict[str, admin_pb2.TenantStatus]:
    """Admin/GetTenants of a scheduler without admin keys, by tenant name."""
    with grpc.insecure_channel(address) as channel:
        report = admin_pb2_grpc.AdminStub(channel).GetTenants(admin_pb2.GetTenantsRequest(), timeout=30)
    return {tenant.name: tenant for tenant in report.tenants}
