"""deploy/kubernetes, checked without a cluster: every overlay rendered by a real kustomize
(kubectl's built-in one), every object validated against the Kubernetes schemas in strict mode,
and what a user would notice on a cluster checked against the code: container arguments parsed by
the services' own parsers, probes and Services on ports those arguments open, executors found by
the planners and both planners by every front-end through headless Services, the front-ends
scaled on CPU, Secrets holding the files deploy/make_certs.py and `splitserve executor-token`
write (made with the commands deploy/kubernetes/README.md gives) and certificates naming what the
pods dial."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from executor_service.__main__ import parse_args as parse_executor_args
from executor_service.serving.kv_fetch import peer_certificate_problem
from executor_service.serving.server import SHUTDOWN_GRACE_S as EXECUTOR_STOP_S
from scheduler_service.__main__ import parse_args as parse_scheduler_args
from scheduler_service.planner.discovery import DNS_PREFIX, split_target
from scheduler_service.process.role_flags import role_options
from scheduler_service.process.server import SHUTDOWN_GRACE_S as SCHEDULER_STOP_S
from scheduler_service.security_options import security_options
from tests.helpers.kustomize_render import (
    Object,
    container_argv,
    container_env,
    cpu_cores,
    kustomize_command,
    render,
)

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
# A recent release kubernetes-validate ships schemas for; strict: unknown fields are errors.
KUBERNETES_VERSION = "1.35"
COMMANDS = ("executor", "scheduler", "gateway", "prepare-model")
# What each container runs: its command, or for the scheduler the role it plays.
ROLES = ("executor", "planner", "frontend", "gateway", "prepare-model")
WORKLOADS = ("Deployment", "StatefulSet")
# Files of make_certs' output that must never reach a pod: the CA's signing key, the client's key.
ADMIN_ONLY = {"ca-key.pem", "client-api-key"}
# The gateway arrived after the services; its containers are checked once its parser exists.
GATEWAY_MISSING = importlib.util.find_spec("clients.openai_gateway") is None
# How long each server takes to stop once its drain is over (uvicorn's is part of its drain).
STOP_S = {
    "executor": EXECUTOR_STOP_S, "planner": SCHEDULER_STOP_S, "frontend": SCHEDULER_STOP_S, "gateway": 0.0,
}  # fmt: skip
# The ports each role's arguments open. A front-end serves no health or metrics port of its own.
OPENED_PORTS = {
    "executor": ("port", "health_port", "metrics_port"),
    "planner": ("port", "health_port", "metrics_port"),
    "frontend": ("port",),
    "gateway": ("port",),
}
HEALTH_PROBE = REPO / "deploy" / "health_probe.py"
# The image's working directory, where its copy of the repository's deploy/ lies.
[IMAGE_WORKDIR] = re.findall(r"^WORKDIR (\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)

RENDERER = kustomize_command()
pytestmark = pytest.mark.skipif(
    RENDERER is None,
    reason="no kustomize renderer: needs kubectl (its built-in kustomize) or kustomize on PATH",
)


# --- rendering and the documented commands ---------------------------------------------------


@dataclass(frozen=True)
class Rendered:
    overlay: str
    objects: list[Object]

    def of_kind(self, kind: str) -> list[Object]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> Object:
        return next(o for o in self.of_kind(kind) if o["metadata"]["name"] == name)

    def workloads(self) -> list[Object]:
        return [o for o in self.objects if o["kind"] in WORKLOADS]

    @property
    def namespace(self) -> str:
        [namespace] = {o["metadata"]["namespace"] for o in self.objects}
        return namespace


@pytest.fixture(scope="module", params=["cpu", "gpu", "gpu-tp2"])
def rendered(request: pytest.FixtureRequest) -> Rendered:
    assert RENDERER is not None
    return Rendered(request.param, render(RENDERER, KUBERNETES / "overlays" / request.param))


def documented_commands() -> list[list[str]]:
    """Every command line in deploy/kubernetes/README.md's code blocks, continuations joined."""
    blocks = re.findall(r"```\n(.*?)```", (KUBERNETES / "README.md").read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [words for line in lines if (words := shlex.split(line, comments=True))]


@dataclass(frozen=True)
class Certs:
    folder: Path
    # What make_certs and the token commands wrote.
    written: set[str]
    # Secret name -> its keys, and the namespace, from the documented `kubectl create secret`s.
    secrets: dict[str, set[str]]
    namespaces: set[str]


def run_documented(command: list[str]) -> None:
    made = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert made.returncode == 0, (command, made.stderr)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    commands = documented_commands()
    make_certs = next(c for c in commands if c[:2] == ["python", "deploy/make_certs.py"])
    folder = tmp_path_factory.mktemp("certs")
    run_documented([sys.executable, make_certs[1], str(folder), *make_certs[3:]])
    # Tokens go into the same folder, made by the installed command the README names.
    tokens = [c for c in commands if c[:2] == ["splitserve", "executor-token"]]
    assert tokens, "the README makes no planner token"
    for _, _, path in tokens:
        assert Path(path).parent == Path(make_certs[2]), path
        splitserve = Path(sys.executable).parent / "splitserve"
        run_documented([str(splitserve), "executor-token", str(folder / Path(path).name)])
    secrets: dict[str, set[str]] = {}
    namespaces = set()
    for words in commands:
        if words[:1] == ["kubectl"] and "create secret generic" in " ".join(words):
            sources = [w.removeprefix("--from-file=") for w in words if w.startswith("--from-file=")]
            # --from-file=PATH names the key after the file: the files must be make_certs' own.
            assert all(Path(s).parent == Path(make_certs[2]) for s in sources), sources
            secrets[words[words.index("generic") + 1]] = {Path(s).name for s in sources}
            namespaces.add(words[words.index("-n") + 1])
    return Certs(folder, {p.name for p in folder.iterdir()}, secrets, namespaces)


# --- the pods' processes ---------------------------------------------------------------------


def pod_spec(workload: Object) -> Object:
    return workload["spec"]["template"]["spec"]


def containers(workload: Object) -> list[Object]:
    pod = pod_spec(workload)
    return [*pod.get("initContainers", []), *pod["containers"]]


def secret_files(workload: Object, container: Object, certs: Certs) -> dict[str, Path]:
    """Container path of each Secret file mounted in the container -> make_certs' file."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        for item in secret.get("items", []) if secret else []:
            files[f"{mount['mountPath']}/{item['path']}"] = certs.folder / item["key"]
    return files


@dataclass(frozen=True)
class Process:
    workload: Object
    container: Object
    command: str
    # Arguments as the kubelet passes them, Secret paths moved to make_certs' output folder.
    args: list[str]
    parsed: Any
    # Secret files mounted in the container: its path -> make_certs' file.
    files: dict[str, Path]

    @property
    def role(self) -> str:
        return self.parsed.role if self.command == "scheduler" else self.command

    @property
    def opened_ports(self) -> set[int]:
        ports = {getattr(self.parsed, name) for name in OPENED_PORTS.get(self.role, ())}
        return ports - {None}

    def container_port(self, port: int | str) -> int:
        if isinstance(port, int):
            return port
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == port)


def parse(command: str, args: list[str]) -> Any:
    if command == "executor":
        return parse_executor_args(args)
    if command == "scheduler":
        return parse_scheduler_args(args)
    if command == "gateway":
        return importlib.import_module("clients.openai_gateway.__main__").parse_args(args)
    # prepare-model's only flag; its parser lives inside main(), which prepares the model.
    assert args[:1] == ["--cache-dir"] and len(args) == 2, args
    return argparse.Namespace(cache_dir=Path(args[1]))


def processes(rendered: Rendered, certs: Certs) -> Iterator[Process]:
    for workload in rendered.workloads():
        for container in containers(workload):
            argv = container_argv(workload, container)
            assert argv[0] == "splitserve" and argv[1] in COMMANDS, argv
            if argv[1] == "gateway" and GATEWAY_MISSING:
                continue
            files = secret_files(workload, container, certs)
            args = [str(files.get(arg, arg)) for arg in argv[2:]]
            yield Process(workload, container, argv[1], args, parse(argv[1], args), files)


def process(rendered: Rendered, certs: Certs, role: str) -> Process:
    if role == "gateway" and GATEWAY_MISSING:
        pytest.skip("clients.openai_gateway does not exist yet: the gateway's arguments are unchecked")
    [found] = [p for p in processes(rendered, certs) if p.role == role]
    return found


def selects(selector: dict[str, str], workload: Object) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return selector.items() <= labels.items()


def selected(rendered: Rendered, selector: dict[str, str]) -> list[str]:
    return [w["metadata"]["name"] for w in rendered.workloads() if selects(selector, w)]


# --- the checks ------------------------------------------------------------------------------


def test_every_object_is_valid_for_kubernetes_in_strict_mode(rendered: Rendered) -> None:
    kinds = {o["kind"] for o in rendered.objects}
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
            "HorizontalPodAutoscaler"} <= kinds
    problems = []
    for obj in rendered.objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            # The path and the message: the exception itself prints the whole schema.
            where = "/".join(map(str, error.absolute_path))
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {error.message}")
    assert not problems, "\n".join(problems)


def test_every_container_runs_splitserve_with_arguments_its_parser_accepts(
    rendered: Rendered, certs: Certs
) -> None:
    seen = {p.role for p in processes(rendered, certs)}
    assert seen == set(ROLES) - ({"gateway"} if GATEWAY_MISSING else set())
    # Read every TLS file, the API keys and the planner token, check the pairs: what each role
    # does at start (the executor's parser already read its own).
    frontend = process(rendered, certs, "frontend").parsed
    security = security_options(frontend)
    assert security.tls is not None and security.api_keys
    planner = process(rendered, certs, "planner").parsed
    security = security_options(planner)
    assert security.executor_tls is not None and security.executor_tls.mutual
    # The Planner API serves mutual TLS; client API keys there would go unused (its callers send
    # the token).
    assert security.tls is not None and security.tls.mutual and security.api_keys is None
    planner_access, frontend_access = role_options(planner), role_options(frontend)
    # Front-ends present the client certificate the planners' client CA signed.
    assert frontend_access.planner_tls is not None and frontend_access.planner_tls.mutual
    assert frontend_access.planner_tls.cert_pem == (certs.folder / "frontend-client.pem").read_bytes()
    assert security.tls.client_ca_pem == frontend_access.planner_tls.ca_pem
    assert not planner_access.insecure_planner
    assert planner_access.planner_token and frontend_access.planner_token == planner_access.planner_token
    executor = process(rendered, certs, "executor").parsed
    assert executor.tls.mutual
    # Executors fetch K/V from each other with a certificate that allows clientAuth, which their
    # server certificate does not.
    assert executor.peer_tls.cert_pem == (certs.folder / "executor-peer.pem").read_bytes()
    assert peer_certificate_problem(executor.tls, executor.peer_tls) is None
    gateway = process(rendered, certs, "gateway").parsed
    assert gateway.tls_ca.read_bytes().startswith(b"-----BEGIN CERTIFICATE")


def test_each_subcommand_runs_the_module_whose_parser_checked_it(
    rendered: Rendered, certs: Certs
) -> None:
    command = pytest.importorskip("scheduler_service.launch.command")
    modules = {
        "executor": "executor_service.__main__",
        "scheduler": "scheduler_service.__main__",
        "gateway": "clients.openai_gateway.__main__",
        "prepare-model": "executor_service.prepare_model",
    }
    for proc in processes(rendered, certs):
        assert command.SUBCOMMANDS[proc.command].module == modules[proc.command]


def health_probe_module() -> Any:
    spec = importlib.util.spec_from_file_location("health_probe", HEALTH_PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exec_probe(proc: Process, command: list[str]) -> Any:
    """The parsed arguments of an exec probe running deploy/health_probe.py, its files moved to
    make_certs' output folder as the container's arguments are."""
    python, script, *args = command
    assert python == "python"
    # The image's copy of this repository's probe.
    assert REPO / Path(script).relative_to(IMAGE_WORKDIR) == HEALTH_PROBE
    return health_probe_module().parse_args([str(proc.files.get(arg, arg)) for arg in args])


def test_probes_and_container_ports_are_ports_the_arguments_open(rendered: Rendered, certs: Certs) -> None:
    for proc in processes(rendered, certs):
        for declared in proc.container.get("ports", []):
            assert declared["containerPort"] in proc.opened_ports, (proc.role, declared)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = proc.container.get(kind)
            if proc.role == "prepare-model":
                assert probe is None
                continue
            assert probe is not None, (proc.role, kind)
            if "exec" in probe:
                parsed = exec_probe(proc, probe["exec"]["command"])
                host, _, port = parsed.address.rpartition(":")
                assert host == "127.0.0.1" and int(port) in proc.opened_ports, (proc.role, kind)
                # A port serving TLS is probed over TLS, trusting the CA mounted beside its certificate.
                if int(port) == proc.parsed.port and getattr(proc.parsed, "tls_cert", None):
                    assert parsed.tls_ca == certs.folder / "ca.pem", (proc.role, kind)
                continue
            action = next(key for key in ("grpc", "tcpSocket", "httpGet") if key in probe)
            port = proc.container_port(probe[action]["port"])
            assert port in proc.opened_ports, (proc.role, kind, port)
            if action == "grpc":
                # The main ports speak TLS, which the kubelet cannot: the plaintext health port.
                assert port == proc.parsed.health_port, (proc.role, kind)


def test_the_front_ends_readiness_probe_reads_health_over_tls(rendered: Rendered, certs: Certs) -> None:
    """The probe as the kubelet runs it, against a server with the front-end's certificate on a
    free port: passes while it serves, fails when it does not (the certificate must name the
    127.0.0.1 the probe dials)."""
    frontend = process(rendered, certs, "frontend")
    command = frontend.container["readinessProbe"]["exec"]["command"]
    parsed = exec_probe(frontend, command)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    key, cert = frontend.parsed.tls_key.read_bytes(), frontend.parsed.tls_cert.read_bytes()
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    try:
        args = [str(frontend.files.get(arg, arg)) for arg in command[2:]]
        args[args.index(parsed.address)] = f"127.0.0.1:{port}"
        for status, exit_status in ((health_pb2.HealthCheckResponse.SERVING, 0),
                                    (health_pb2.HealthCheckResponse.NOT_SERVING, 1)):
            servicer.set("", status)
            probed = subprocess.run([sys.executable, str(HEALTH_PROBE), *args], capture_output=True,
                                    text=True, timeout=30, check=False)
            assert probed.returncode == exit_status, probed.stdout + probed.stderr
    finally:
        server.stop(None)


def test_services_reach_ports_their_pods_open(rendered: Rendered, certs: Certs) -> None:
    by_workload = {p.workload["metadata"]["name"]: p for p in processes(rendered, certs)
                   if p.role != "prepare-model"}
    for service in rendered.of_kind("Service"):
        [target] = selected(rendered, service["spec"]["selector"])
        proc = by_workload[target]
        for port in service["spec"]["ports"]:
            target_port = proc.container_port(port["targetPort"])
            assert target_port in proc.opened_ports, port
            # Inside the cluster each port keeps the number the README and the flags use.
            assert target_port == port["port"], port
    # The gateway's --server is the front-ends' client API, through their Service.
    gateway, frontend = process(rendered, certs, "gateway"), process(rendered, certs, "frontend")
    host, _, port = gateway.parsed.server.rpartition(":")
    service = rendered.one("Service", host)
    assert selected(rendered, service["spec"]["selector"]) == [frontend.workload["metadata"]["name"]]
    [dialled] = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    assert frontend.container_port(dialled["targetPort"]) == frontend.parsed.port


def test_the_planners_drive_every_pod_of_the_headless_executor_service(
    rendered: Rendered, certs: Certs
) -> None:
    planner = process(rendered, certs, "planner")
    executor = process(rendered, certs, "executor")
    [target] = planner.parsed.executor
    assert target.startswith(DNS_PREFIX)
    host, port = split_target(target)
    service_name, namespace, *domain = host.split(".")
    # Written as $(POD_NAMESPACE), expanded from the downward API as the kubelet does.
    assert "$(POD_NAMESPACE)" in " ".join(planner.container["args"])
    assert namespace == rendered.namespace
    assert domain == ["svc", "cluster", "local"]
    service = rendered.one("Service", service_name)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    assert selected(rendered, service["spec"]["selector"]) == [executor.workload["metadata"]["name"]]
    assert executor.workload["kind"] == "StatefulSet"
    assert executor.workload["spec"]["serviceName"] == service_name
    assert port == executor.parsed.port
    assert [executor.container_port(p["targetPort"]) for p in service["spec"]["ports"]] == [port]


def test_every_front_end_names_each_planner_pod_through_their_headless_service(
    rendered: Rendered, certs: Certs
) -> None:
    frontend, planner = process(rendered, certs, "frontend"), process(rendered, certs, "planner")
    statefulset = planner.workload
    assert statefulset["kind"] == "StatefulSet"
    # Two: one holds the executors, the other takes them when it dies.
    assert statefulset["spec"]["replicas"] == 2
    assert "$(POD_NAMESPACE)" in " ".join(frontend.container["args"])
    named = set()
    for address in frontend.parsed.planner:
        host, _, port = address.rpartition(":")
        pod, service_name, namespace, *domain = host.split(".")
        assert (namespace, domain) == (rendered.namespace, ["svc", "cluster", "local"]), address
        assert service_name == statefulset["spec"]["serviceName"], address
        assert int(port) == planner.parsed.port, address
        named.add(pod)
    # A StatefulSet's pods are NAME-0 .. NAME-(replicas-1), each with a DNS name of its own.
    name, replicas = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
    assert named == {f"{name}-{ordinal}" for ordinal in range(replicas)}
    service = rendered.one("Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    # The standby is never ready (health is SERVING only on the planner holding executors), and
    # its name must resolve all the same.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert selected(rendered, service["spec"]["selector"]) == [name]
    [dialled] = [p for p in service["spec"]["ports"] if p["port"] == planner.parsed.port]
    assert planner.container_port(dialled["targetPort"]) == planner.parsed.port


def test_the_planner_replicas_are_two_holders_to_the_executors(rendered: Rendered, certs: Certs) -> None:
    """Both replicas present the same client certificate; executors tell them apart by the id
    each claims beside it, which must therefore differ: left at its default (HOSTNAME:PORT, the
    hostname being the pod's own name), not fixed in the shared template."""
    planner = process(rendered, certs, "planner")
    assert planner.parsed.scheduler_id is None
    assert "hostname" not in pod_spec(planner.workload)


def test_the_front_ends_are_scaled_on_cpu(rendered: Rendered, certs: Certs) -> None:
    frontend = process(rendered, certs, "frontend")
    [autoscaler] = rendered.of_kind("HorizontalPodAutoscaler")
    spec = autoscaler["spec"]
    target = spec["scaleTargetRef"]
    assert rendered.one(target["kind"], target["name"]) is frontend.workload
    assert target["apiVersion"] == frontend.workload["apiVersion"]
    [metric] = spec["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 100
    # Utilization is measured against the request, which must be set.
    assert cpu_cores(frontend.container["resources"]["requests"]["cpu"]) > 0
    assert 2 <= spec["minReplicas"] < spec["maxReplicas"]
    # A count in the Deployment would reset the autoscaler's at every `kubectl apply`.
    assert "replicas" not in frontend.workload["spec"]


def test_disruption_budgets_select_one_workload_each(rendered: Rendered) -> None:
    budgets = {b["metadata"]["name"]: selected(rendered, b["spec"]["selector"]["matchLabels"])
               for b in rendered.of_kind("PodDisruptionBudget")}
    assert all(len(names) == 1 for names in budgets.values()), budgets
    assert {names[0] for names in budgets.values()} == {w["metadata"]["name"] for w in rendered.workloads()}
    # A drain never takes both planners at once.
    [planner_budget] = [b for b in rendered.of_kind("PodDisruptionBudget")
                        if budgets[b["metadata"]["name"]] == ["splitserve-planner"]]
    assert planner_budget["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize(
    ("target", "sources"), [("executor", ("planner", "executor")), ("planner", ("frontend",))]
)
def test_network_policies_let_only_the_callers_and_the_probes_in(
    rendered: Rendered, certs: Certs, target: str, sources: tuple[str, ...]
) -> None:
    """The Executor API from the planners and the other executors (which fetch K/V from it)
    alone, the Planner API from the front-ends alone; health (for the kubelet) and metrics from
    anywhere."""
    callee = process(rendered, certs, target)
    callers = [process(rendered, certs, source).workload for source in sources]
    callee_name = callee.workload["metadata"]["name"]
    [policy] = [p for p in rendered.of_kind("NetworkPolicy")
                if selected(rendered, p["spec"]["podSelector"]["matchLabels"]) == [callee_name]]
    allowed_from: dict[str, set[int]] = {w["metadata"]["name"]: set() for w in rendered.workloads()}
    allowed_from_anyone = set()
    for rule in policy["spec"]["ingress"]:
        ports = {callee.container_port(p["port"]) for p in rule["ports"]}
        selectors = [s["podSelector"]["matchLabels"] for s in rule.get("from", [])]
        if not selectors:
            allowed_from_anyone |= ports
        for workload in rendered.workloads():
            if any(selects(s, workload) for s in selectors):
                allowed_from[workload["metadata"]["name"]] |= ports
    for workload in rendered.workloads():
        allowed = callee.parsed.port in allowed_from[workload["metadata"]["name"]]
        assert allowed == any(workload is caller for caller in callers), workload["metadata"]["name"]
    assert callee.parsed.port not in allowed_from_anyone
    assert callee.parsed.health_port in allowed_from_anyone
    assert callee.parsed.metrics_port in allowed_from_anyone
    # The kubelet's probes come from the node, which no pod selector names.
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = callee.container[kind]
        action = next(key for key in ("grpc", "tcpSocket", "httpGet") if key in probe)
        assert callee.container_port(probe[action]["port"]) in allowed_from_anyone, (target, kind)


def test_secrets_hold_only_files_make_certs_writes_and_pods_can_read_them(
    rendered: Rendered, certs: Certs
) -> None:
    assert certs.namespaces == {rendered.namespace}
    for documented in certs.secrets.values():
        assert documented <= certs.written - ADMIN_ONLY
    for workload in rendered.workloads():
        pod = pod_spec(workload)
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        for volume in pod.get("volumes", []):
            if "secret" not in volume:
                continue
            secret = volume["secret"]
            keys = {item["key"] for item in secret["items"]}
            assert keys <= certs.secrets[secret["secretName"]], (workload["metadata"]["name"], keys)
            # Group-readable (fsGroup), nothing for others.
            assert secret["defaultMode"] & 0o040 and not secret["defaultMode"] & 0o007
            mounts = [m for c in containers(workload) for m in c.get("volumeMounts", [])
                      if m["name"] == volume["name"]]
            assert mounts and all(m.get("readOnly") for m in mounts)


def test_certificates_name_what_the_pods_dial(rendered: Rendered, certs: Certs) -> None:
    def names(pem: str) -> set[str]:
        cert = x509.load_pem_x509_certificate((certs.folder / pem).read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return set(san.get_values_for_type(x509.DNSName))

    planner = process(rendered, certs, "planner").parsed
    assert planner.executor_tls_server_name in names("executor.pem")
    # The Planner API is TLS, and every front-end checks the planners' certificate by its name
    # (each planner pod is dialled by a name of its own).
    assert (planner.tls_cert, planner.tls_key) == (certs.folder / "planner.pem", certs.folder / "planner-key.pem")
    frontend = role_options(process(rendered, certs, "frontend").parsed)
    assert frontend.planner_tls is not None
    assert frontend.planner_tls.server_name in names("planner.pem")
    assert frontend.planner_tls.ca_pem == (certs.folder / "ca.pem").read_bytes()
    # Executors dial each other by pod IP too, to fetch K/V.
    executor = process(rendered, certs, "executor").parsed
    assert executor.peer_tls.channel_options() == [("grpc.ssl_target_name_override", planner.executor_tls_server_name)]
    gateway = process(rendered, certs, "gateway").parsed
    host = gateway.server.rpartition(":")[0]
    assert host in names("scheduler.pem")
    # Clients in other namespaces dial the qualified name.
    assert f"{host}.{rendered.namespace}.svc" in names("scheduler.pem")
    assert gateway.tls_ca == certs.folder / "ca.pem"


def test_termination_grace_outlasts_the_drain(rendered: Rendered, certs: Certs) -> None:
    for proc in processes(rendered, certs):
        if proc.role not in STOP_S:
            continue
        parsed = proc.parsed
        drain = parsed.drain_timeout_s if proc.role == "executor" else parsed.drain_timeout
        grace = pod_spec(proc.workload)["terminationGracePeriodSeconds"]
        assert grace > drain + STOP_S[proc.role], (proc.role, grace, drain)


def test_executor_threads_follow_its_cpu_request(rendered: Rendered, certs: Certs) -> None:
    executor = process(rendered, certs, "executor")
    cores = math.ceil(cpu_cores(executor.container["resources"]["requests"]["cpu"]))
    assert executor.parsed.threads == cores
    assert container_env(executor.workload, executor.container)["OMP_NUM_THREADS"] == str(cores)


def test_read_only_root_filesystems_leave_the_caches_writable(rendered: Rendered, certs: Certs) -> None:
    for proc in processes(rendered, certs):
        pod = pod_spec(proc.workload)
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
        assert proc.container["securityContext"]["readOnlyRootFilesystem"] is True
        scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        writable = [m["mountPath"] for m in proc.container["volumeMounts"]
                    if m["name"] in scratch and not m.get("readOnly")]
        env = container_env(proc.workload, proc.container)
        # HOME: whatever a library caches under ~; the executor also compiles its kernel.
        needed = ["HOME", *(["SPLITSERVE_KERNEL_CACHE"] if proc.role == "executor" else [])]
        for variable in needed:
            assert any(Path(env[variable]).is_relative_to(w) for w in writable), (proc.role, variable)


def mounted_volume(container: Object, path: Path) -> str:
    [name] = [m["name"] for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"])]
    return name


def test_the_services_read_the_model_their_init_container_prepared(rendered: Rendered, certs: Certs) -> None:
    served = {"executor": "model_dir", "planner": "tokenizer", "frontend": "tokenizer"}
    for proc in processes(rendered, certs):
        if proc.role not in served:
            continue
        [prepare] = [p for p in processes(rendered, certs)
                     if p.workload is proc.workload and p.command == "prepare-model"]
        folder = getattr(proc.parsed, served[proc.role])
        assert folder == prepare.parsed.cache_dir
        # The same pod volume at the same place: what the init container wrote.
        volume = mounted_volume(proc.container, folder)
        assert volume == mounted_volume(prepare.container, folder)
        emptied = {v["name"] for v in pod_spec(proc.workload)["volumes"] if "emptyDir" in v}
        assert volume in emptied


def test_only_the_gpu_overlay_asks_for_gpus(rendered: Rendered, certs: Certs) -> None:
    executor = process(rendered, certs, "executor")
    gpus = {(p.workload["metadata"]["name"], p.container["name"]):
            p.container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            for p in processes(rendered, certs)}
    if rendered.overlay.startswith("gpu"):
        assert executor.parsed.device == "cuda"
        # One GPU per rank, all in the executor's pod.
        assert gpus.pop(("splitserve-executor", "executor")) == executor.parsed.tensor_parallel_size
        assert pod_spec(executor.workload)["tolerations"]
    else:
        assert executor.parsed.device == "cpu"
    assert not any(gpus.values()), gpus


def test_ranks_of_a_sharded_executor_get_shared_memory(rendered: Rendered, certs: Certs) -> None:
    executor = process(rendered, certs, "executor")
    if executor.parsed.tensor_parallel_size == 1:
        return
    # NCCL between the ranks of one pod goes through /dev/shm, 64 MiB unless a volume widens it.
    shm = mounted_volume(executor.container, Path("/dev/shm"))
    [volume] = [v for v in pod_spec(executor.workload)["volumes"] if v["name"] == shm]
    assert volume["emptyDir"]["medium"] == "Memory"
