"""docker-compose.secure.yml over docker-compose.yml, and deploy/make_certs.py, checked without a
Docker engine (see tests/e2e/test_compose.py, whose helpers run the services here too).

The override is merged into the base file as `docker compose -f docker-compose.yml -f
docker-compose.secure.yml` merges them (compose-spec merge rules, for the keys these files use),
and the merged configuration is what is checked and run. Beyond test_compose.py's stand-ins, a
local run substitutes:
- the bind-mounted ./certs at /certs -> a temp folder;
- the executor's health port 50062 -> a free port;
- make-certs' `--service-owner` is dropped: it hands files from root to the image's user, and
  here every process runs as the same user.
"""

from __future__ import annotations

import datetime
import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from clients import Client
from clients.errors import SplitserveError
from protos.executor_access import DEFAULT_SCHEDULER_NAME
from tests.e2e.test_compose import (
    COMPOSE_FILE,
    FIXED_PORTS,
    MODEL_PATH,
    PLANNER_TOKEN_PATH,
    TOKEN_PATH,
    flag,
)
from tests.helpers.compose_services import (
    HOST_PORT,
    REPO_ROOT,
    LocalStandIns,
    RunningServices,
    bring_up,
    dependency_condition,
    free_ports,
    own_services,
    startup_order,
)

SECURE_FILE = REPO_ROOT / "docker-compose.secure.yml"
MAKE_CERTS = REPO_ROOT / "deploy" / "make_certs.py"
CERTS_SOURCE = "./certs"
# The ports the override adds: the executor's and the planner's plaintext health.
HEALTH_PORTS = (50062, 50063)
# What the image runs as (Dockerfile: useradd --uid 10001).
IMAGE_USER = "10001:10001"
CERT_FILES = {
    "ca.pem", "scheduler.pem", "planner.pem", "executor.pem", "scheduler-client.pem", "executor-peer.pem",
    "frontend-client.pem",
}  # fmt: skip
KEY_FILES = {
    "ca-key.pem", "scheduler-key.pem", "planner-key.pem", "executor-key.pem", "scheduler-client-key.pem",
    "executor-peer-key.pem", "frontend-client-key.pem",
}  # fmt: skip
API_KEY_FILES = {"api-keys", "client-api-key"}
ALL_FILES = CERT_FILES | KEY_FILES | API_KEY_FILES
LOCAL_NAMES = {"localhost", "127.0.0.1"}
SCHEDULER_IDENTITY = "splitserve-scheduler"
# The name executors present to each other: signed by the CA, but no scheduler's.
EXECUTOR_PEER_IDENTITY = "splitserve-executor-peer"
# Flags that name a file in the certs folder, on each server.
EXECUTOR_FILE_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca", "--tls-peer-cert", "--tls-peer-key")
PLANNER_FILE_FLAGS = (
    "--executor-tls-ca", "--executor-tls-cert", "--executor-tls-key", "--tls-cert", "--tls-key", "--tls-client-ca",
)  # fmt: skip
FRONTEND_FILE_FLAGS = (
    "--tls-cert", "--tls-key", "--api-key-file", "--planner-tls-ca", "--planner-tls-cert", "--planner-tls-key",
)  # fmt: skip
FILE_FLAGS = {
    "executor": EXECUTOR_FILE_FLAGS,
    "planner": PLANNER_FILE_FLAGS,
    "frontend": FRONTEND_FILE_FLAGS,
    "gateway": ("--tls-ca",),
}


# --- merging, as `docker compose -f A -f B` does ---------------------------------------------

# Sequences an override replaces; every other one it extends (compose-spec, "Merge").
REPLACED_SEQUENCES = {("command",), ("entrypoint",), ("healthcheck", "test")}


def mount_target(volume: str) -> str:
    """The container path of a short-syntax volume, SOURCE:TARGET[:MODE]."""
    return volume.split(":")[1]


def merge_sequence(path: tuple[str, ...], base: list[Any], override: list[Any]) -> list[Any]:
    if path in REPLACED_SEQUENCES:
        return override
    if path == ("volumes",):
        # A mount is unique by its target: the override's wins.
        targets = {mount_target(volume) for volume in override}
        return [v for v in base if mount_target(v) not in targets] + override
    return base + [item for item in override if item not in base]


def merge_service(base: Any, override: Any, path: tuple[str, ...] = ()) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge_service(base[key], value, (*path, key)) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(override, list):
        return merge_sequence(path, base, override)
    return override


def merge_compose(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = {**base, **{k: v for k, v in override.items() if k != "services"}}
    services = dict(base["services"])
    for name, spec in override.get("services", {}).items():
        services[name] = merge_service(services[name], spec) if name in services else spec
    merged["services"] = services
    return merged


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def override() -> dict[str, Any]:
    return yaml.safe_load(SECURE_FILE.read_text())


@pytest.fixture(scope="module")
def secure(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    return merge_compose(base, override)


def certs_mount(spec: dict[str, Any]) -> str:
    """The one volume of a service bind-mounted from ./certs."""
    mounts = [v for v in spec.get("volumes", []) if v.split(":")[0] == CERTS_SOURCE]
    assert len(mounts) == 1, spec.get("volumes")
    return mounts[0]


def run_make_certs(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, str(MAKE_CERTS), str(out), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result


# --- the merged configuration ----------------------------------------------------------------


def test_make_certs_is_a_one_shot_the_servers_wait_for(secure: dict[str, Any]) -> None:
    services = secure["services"]
    make_certs = services["make-certs"]
    assert make_certs["restart"] == "no"
    assert "healthcheck" not in make_certs and "ports" not in make_certs
    assert make_certs["command"][:2] == ["python", "deploy/make_certs.py"]
    assert (REPO_ROOT / make_certs["command"][1]).is_file()
    # Same image as the others: the compose file builds one.
    assert make_certs["image"] == services["executor"]["image"]
    assert make_certs["build"] == services["executor"]["build"]
    assert dependency_condition(services, "make-certs") == {"service_completed_successfully"}
    for name in ("executor", "planner", "frontend"):
        assert services[name]["depends_on"]["make-certs"] == {
            "condition": "service_completed_successfully"
        }
    # The base file's dependencies survive the merge.
    assert services["executor"]["depends_on"]["prepare-model"] == {
        "condition": "service_completed_successfully"
    }
    assert services["planner"]["depends_on"]["executor"] == {"condition": "service_healthy"}
    assert services["frontend"]["depends_on"]["planner"] == {"condition": "service_healthy"}
    order = startup_order(services)
    assert order.index("make-certs") < order.index("executor") < order.index("planner") < order.index("frontend")


def test_secure_commands_extend_the_plain_ones(
    base: dict[str, Any], secure: dict[str, Any]
) -> None:
    # Compose replaces a command; the override repeats the base one, and must keep up with it.
    for name in FILE_FLAGS:
        plain = base["services"][name]["command"]
        command = secure["services"][name]["command"]
        assert command[: len(plain)] == plain, name
        assert len(command) > len(plain), name


def test_executor_demands_mutual_tls_and_stays_unpublished(secure: dict[str, Any]) -> None:
    services = secure["services"]
    executor, planner = services["executor"]["command"], services["planner"]["command"]
    for name in EXECUTOR_FILE_FLAGS:
        flag(executor, name)
    assert "ports" not in services["executor"]
    # The planner presents a certificate from the CA the executor checks, and checks the
    # executor's against the CA that issued it.
    assert flag(planner, "--executor-tls-ca") == flag(executor, "--tls-client-ca")
    flag(planner, "--executor-tls-cert")
    flag(planner, "--executor-tls-key")
    # The front-end never dials an executor: no certificate of the planner's for it.
    assert not any(arg.startswith("--executor-tls") for arg in services["frontend"]["command"])


def test_front_end_serves_tls_with_api_keys(base: dict[str, Any], secure: dict[str, Any]) -> None:
    services = secure["services"]
    for name in FRONTEND_FILE_FLAGS:
        flag(services["frontend"]["command"], name)
    # The planner takes no client keys: its callers are front-ends, with the base file's token.
    assert "--api-key-file" not in services["planner"]["command"]
    # Published ports unchanged.
    for name in ("frontend", "planner"):
        assert sorted(services[name]["ports"]) == sorted(base["services"][name]["ports"]), name


def test_healthchecks_probe_each_server_as_it_serves(
    base: dict[str, Any], secure: dict[str, Any]
) -> None:
    services = secure["services"]
    published = {port.split(":")[-1] for spec in services.values() for port in spec.get("ports", [])}
    probe = ["CMD", "python", "deploy/health_probe.py"]
    # The executor's port demands a client certificate: its plaintext health port, unpublished.
    # So does the planner's (front-ends present theirs): its plaintext health port, unpublished.
    health_ports = set()
    for name in ("executor", "planner"):
        server = services[name]
        health_port = flag(server["command"], "--health-port")
        assert health_port != flag(server["command"], "--port")
        assert server["healthcheck"]["test"] == [*probe, f"127.0.0.1:{health_port}"]
        assert health_port not in published
        health_ports.add(health_port)
    assert health_ports == {str(port) for port in HEALTH_PORTS}
    # The front-end's is TLS, checked against the CA the gateway trusts too.
    frontend = services["frontend"]
    assert frontend["healthcheck"]["test"] == [
        *probe, f"127.0.0.1:{flag(frontend['command'], '--port')}",
        "--tls-ca", flag(services["gateway"]["command"], "--tls-ca"),
    ]  # fmt: skip
    for name in ("executor", "planner", "frontend"):
        # Timing still comes from the base file.
        for key in ("interval", "timeout", "start_period", "retries"):
            assert services[name]["healthcheck"][key] == base["services"][name]["healthcheck"][key]


def test_every_file_a_command_names_lies_in_the_certs_mount(
    secure: dict[str, Any], tmp_path: Path
) -> None:
    services = secure["services"]
    make_certs = services["make-certs"]
    mount = certs_mount(make_certs)
    target = PurePosixPath(mount_target(mount))
    # make-certs writes there; the servers only read.
    assert not mount.endswith(":ro")
    assert make_certs["command"][2] == str(target)
    assert make_certs["user"] == "root"
    assert flag(make_certs["command"], "--service-owner") == IMAGE_USER
    run_make_certs(tmp_path)
    written = {path.name for path in tmp_path.iterdir()}
    for name, file_flags in FILE_FLAGS.items():
        spec = services[name]
        assert certs_mount(spec) == f"{CERTS_SOURCE}:{target}:ro", name
        command = spec["command"]
        for file_flag in file_flags:
            path = PurePosixPath(flag(command, file_flag))
            assert path.parent == target, (name, file_flag, path)
            assert path.name in written, (name, file_flag, path)
        # Any other absolute path is the model, or a token beside it, in their volume.
        others = [
            PurePosixPath(arg)
            for arg in command
            if arg.startswith("/") and PurePosixPath(arg).parent != target
        ]
        assert all(str(path) in (MODEL_PATH, TOKEN_PATH, PLANNER_TOKEN_PATH) for path in others), others
    # The private keys each side reads are the ones that match what it presents.
    executor, planner = services["executor"]["command"], services["planner"]["command"]
    frontend = services["frontend"]["command"]
    assert flag(executor, "--tls-key").endswith("/executor-key.pem")
    assert flag(executor, "--tls-cert").endswith("/executor.pem")
    assert flag(frontend, "--tls-cert").endswith("/scheduler.pem")
    assert flag(frontend, "--tls-key").endswith("/scheduler-key.pem")
    assert flag(planner, "--executor-tls-cert").endswith("/scheduler-client.pem")
    assert flag(planner, "--executor-tls-key").endswith("/scheduler-client-key.pem")
    assert flag(planner, "--tls-cert").endswith("/planner.pem")
    assert flag(planner, "--tls-key").endswith("/planner-key.pem")
    assert flag(frontend, "--planner-tls-cert").endswith("/frontend-client.pem")
    assert flag(frontend, "--planner-tls-key").endswith("/frontend-client-key.pem")
    # The planner checks front-ends' certificates against the CA that signs them.
    assert flag(planner, "--tls-client-ca") == flag(frontend, "--planner-tls-ca")
    # Executors fetch K/V from each other with a client certificate of their own.
    assert flag(executor, "--tls-peer-cert").endswith("/executor-peer.pem")
    assert flag(executor, "--tls-peer-key").endswith("/executor-peer-key.pem")


def test_certificates_name_the_hosts_dialled(secure: dict[str, Any]) -> None:
    services = secure["services"]
    make_certs = services["make-certs"]["command"]
    names = {
        option: {make_certs[i + 1] for i, arg in enumerate(make_certs) if arg == option}
        for option in ("--executor-name", "--scheduler-name", "--planner-name")
    }
    match = HOST_PORT.fullmatch(flag(services["planner"]["command"], "--executor"))
    assert match, "the planner dials one executor by HOST:PORT"
    assert match.group(1) in names["--executor-name"]
    match = HOST_PORT.fullmatch(flag(services["frontend"]["command"], "--planner"))
    assert match, "the front-end dials one planner by HOST:PORT"
    assert match.group(1) in names["--planner-name"]
    match = HOST_PORT.fullmatch(flag(services["gateway"]["command"], "--server"))
    assert match, "the gateway dials the front-end by HOST:PORT"
    assert match.group(1) in names["--scheduler-name"]


def test_dockerfile_installs_cryptography_for_make_certs() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    install = next(
        line for line in dockerfile.splitlines() if line.startswith("RUN pip install -c constraints.txt")
    )
    assert "certs" in install, install


# --- deploy/make_certs.py --------------------------------------------------------------------


def load_cert(folder: Path, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate((folder / name).read_bytes())


def san_names(cert: x509.Certificate) -> set[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return ips | set(san.get_values_for_type(x509.DNSName))


def usages(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def snapshot(folder: Path) -> dict[str, tuple[bytes, int, int, int]]:
    """Content, mode, inode and modification time of every file: a rewrite changes the inode
    (files are replaced, never edited), an edit the time."""
    return {
        path.name: (
            path.read_bytes(),
            path.stat().st_mode,
            path.stat().st_ino,
            path.stat().st_mtime_ns,
        )
        for path in sorted(folder.iterdir())
    }


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs") / "out"
    run_make_certs(
        out,
        "--executor-name", "executor",
        "--executor-name", "10.1.2.3",
        "--scheduler-name", "api.example.org",
        "--planner-name", "planner.example.org",
        "--days", "30",
    )  # fmt: skip
    return out


def test_make_certs_writes_the_set_with_private_modes(made: Path) -> None:
    assert {path.name for path in made.iterdir()} == ALL_FILES
    for name in ALL_FILES:
        mode = stat.S_IMODE((made / name).stat().st_mode)
        assert mode == (0o644 if name in CERT_FILES else 0o600), (name, oct(mode))


def test_make_certs_server_names_and_purposes(made: Path) -> None:
    scheduler, executor = load_cert(made, "scheduler.pem"), load_cert(made, "executor.pem")
    planner = load_cert(made, "planner.pem")
    assert san_names(scheduler) == {"api.example.org"} | LOCAL_NAMES
    assert san_names(executor) == {"executor", "10.1.2.3"} | LOCAL_NAMES
    assert san_names(planner) == {"planner.example.org"} | LOCAL_NAMES
    for cert in (scheduler, executor, planner):
        assert usages(cert) == {ExtendedKeyUsageOID.SERVER_AUTH}
    client = load_cert(made, "scheduler-client.pem")
    assert usages(client) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    common_name = client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert common_name == SCHEDULER_IDENTITY
    # The executors' client certificate: for logging in to a peer only, under a name of its own
    # (no host names: no one serves with it).
    peer = load_cert(made, "executor-peer.pem")
    assert usages(peer) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert peer.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == EXECUTOR_PEER_IDENTITY
    assert EXECUTOR_PEER_IDENTITY not in DEFAULT_SCHEDULER_NAME.split(",")
    with pytest.raises(x509.ExtensionNotFound):
        peer.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    # The front-ends' client certificate, which planners check (--tls-client-ca).
    frontend = load_cert(made, "frontend-client.pem")
    assert usages(frontend) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert frontend.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "splitserve-frontend"
    lifetime = client.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    assert datetime.timedelta(days=29) < lifetime <= datetime.timedelta(days=30, hours=1)


def test_make_certs_chains_every_certificate_to_the_ca(made: Path) -> None:
    ca = load_cert(made, "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    ca.verify_directly_issued_by(ca)
    for name in CERT_FILES - {"ca.pem"}:
        cert = load_cert(made, name)
        cert.verify_directly_issued_by(ca)  # raises unless the CA's key signed it
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        key = serialization.load_pem_private_key(
            (made / name.replace(".pem", "-key.pem")).read_bytes(), password=None
        )
        public = serialization.PublicFormat.SubjectPublicKeyInfo
        der = serialization.Encoding.DER
        assert key.public_key().public_bytes(der, public) == cert.public_key().public_bytes(
            der, public
        )


def test_make_certs_api_key_is_shared_and_long(made: Path) -> None:
    key = (made / "client-api-key").read_text().strip()
    # The scheduler refuses keys under 16 characters.
    assert len(key) >= 32
    assert (made / "api-keys").read_text().split() == [key]


def test_make_certs_second_run_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    run_make_certs(out, "--executor-name", "executor")
    before = snapshot(out)
    result = run_make_certs(out, "--executor-name", "executor")
    assert snapshot(out) == before
    assert "event=certs_unchanged" in result.stderr
    assert "event=file_written" not in result.stderr


def test_make_certs_reissues_only_what_is_missing_or_expiring(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    run_make_certs(out)
    # The executor's certificate gone, and the scheduler's lapsing within the day.
    (out / "executor.pem").unlink()
    ca = load_cert(out, "ca.pem")
    ca_key = serialization.load_pem_private_key((out / "ca-key.pem").read_bytes(), password=None)
    old = load_cert(out, "scheduler.pem")
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(old.subject)
        .issuer_name(ca.subject)
        .public_key(old.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(hours=12))
    )
    for extension in old.extensions:
        builder = builder.add_extension(extension.value, extension.critical)
    lapsing = builder.sign(ca_key, hashes.SHA256())
    (out / "scheduler.pem").write_bytes(lapsing.public_bytes(serialization.Encoding.PEM))
    before = snapshot(out)

    run_make_certs(out)
    after = snapshot(out)
    changed = {name for name in after if after[name] != before.get(name)}
    assert changed == {"executor.pem", "executor-key.pem", "scheduler.pem", "scheduler-key.pem"}
    renewed = load_cert(out, "scheduler.pem")
    assert renewed.not_valid_after_utc - now > datetime.timedelta(days=300)
    renewed.verify_directly_issued_by(ca)
    # A name asked for that the certificate lacks reissues it too.
    run_make_certs(out, "--executor-name", "gpu-7")
    assert "gpu-7" in san_names(load_cert(out, "executor.pem"))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root, as in the make-certs container")
def test_make_certs_service_owner_splits_files_between_services_and_folder_owner(
    tmp_path: Path,
) -> None:
    out = tmp_path / "certs"
    out.mkdir()
    os.chown(out, 23456, 23456)  # the host user who made ./certs
    run_make_certs(out, "--service-owner", "12345:12345")
    service_files = {
        "scheduler-key.pem",
        "planner-key.pem",
        "executor-key.pem",
        "scheduler-client-key.pem",
        "executor-peer-key.pem",
        "frontend-client-key.pem",
        "api-keys",
    }
    for path in out.iterdir():
        expected = 12345 if path.name in service_files else 23456
        assert (path.stat().st_uid, path.stat().st_gid) == (expected, expected), path.name
    before = snapshot(out)
    run_make_certs(out, "--service-owner", "12345:12345")
    assert snapshot(out) == before


def test_grpc_accepts_the_certificates_for_mutual_tls(made: Path) -> None:
    """A server with executor.pem and the CA as client CA takes the scheduler's client
    certificate, the executors' peer certificate and the front-ends' client certificate (as a
    planner with --tls-client-ca does), and turns away a client without one or
    with executor.pem, which allows serverAuth only: what the executor's flags set up."""

    def read(name: str) -> bytes:
        return (made / name).read_bytes()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    credentials = grpc.ssl_server_credentials(
        [(read("executor-key.pem"), read("executor.pem"))],
        root_certificates=read("ca.pem"),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        request = health_pb2.HealthCheckRequest()
        for client in ("scheduler-client", "executor-peer", "frontend-client"):
            mutual = grpc.ssl_channel_credentials(
                read("ca.pem"), read(f"{client}-key.pem"), read(f"{client}.pem")
            )
            for host in ("127.0.0.1", "localhost"):
                with grpc.secure_channel(f"{host}:{port}", mutual) as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, client
        anonymous = grpc.ssl_channel_credentials(read("ca.pem"))
        server_as_client = grpc.ssl_channel_credentials(
            read("ca.pem"), read("executor-key.pem"), read("executor.pem")
        )
        for credentials in (anonymous, server_as_client):
            with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


# --- the secured services, run as local processes --------------------------------------------


@dataclass(slots=True, frozen=True)
class SecureStandIns(LocalStandIns):
    """test_compose.py's stand-ins, plus the certs folder."""

    certs: Path
    certs_target: str = "/certs"

    def arg(self, text: str) -> str:
        if text == self.certs_target or text.startswith(self.certs_target + "/"):
            return str(self.certs) + text.removeprefix(self.certs_target)
        return LocalStandIns.arg(self, text)

    def command(self, command: list[str]) -> list[str]:
        if "--service-owner" in command:
            index = command.index("--service-owner")
            command = command[:index] + command[index + 2 :]
        return LocalStandIns.command(self, command)


def health_check(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


def demands_client_certificate(address: str, tls: grpc.ChannelCredentials, certs: Path, client: str) -> None:
    """TLS alone gets nothing from the server at address; TLS with the client certificate
    certs/{client}.pem (and its key) gets its health answered."""
    with grpc.secure_channel(address, tls) as channel:
        with pytest.raises(grpc.RpcError) as refused_anonymous:
            health_check(channel)
        assert refused_anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
    mutual = grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(), (certs / f"{client}-key.pem").read_bytes(), (certs / f"{client}.pem").read_bytes()
    )
    with grpc.secure_channel(address, mutual) as channel:
        assert health_check(channel) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
def test_secured_services_come_up_and_demand_credentials(
    secure: dict[str, Any], tmp_path: Path, running: RunningServices
) -> None:
    services = secure["services"]
    ports = (*FIXED_PORTS, *HEALTH_PORTS)
    stand_ins = SecureStandIns(
        volume=tmp_path / "models-volume",
        ports=dict(zip(ports, free_ports(len(ports)))),
        certs=tmp_path / "certs",
        certs_target=mount_target(certs_mount(services["make-certs"])),
    )
    stand_ins.volume.mkdir()
    stand_ins.certs.mkdir()
    bring_up(own_services(services), stand_ins, running)

    def read(name: str) -> bytes:
        return (stand_ins.certs / name).read_bytes()

    key = read("client-api-key").decode().strip()
    address = f"127.0.0.1:{stand_ins.ports[50051]}"
    tls = grpc.ssl_channel_credentials(read("ca.pem"))

    # As the README shows: the library with the CA and the key, then the command-line client.
    with Client(address, timeout=60, api_key=key, root_certificates=read("ca.pem")) as client:
        result = client.generate(
            messages=[("user", "What is the capital of France?")], max_tokens=16, temperature=0.0
        )
    assert "Paris" in result.text
    cli = subprocess.run(
        [
            sys.executable, "-m", "clients", "generate", "--server", address,
            "--tls-ca", str(stand_ins.certs / "ca.pem"),
            "--api-key-file", str(stand_ins.certs / "client-api-key"),
            "--chat", "--max-tokens", "16", "--temperature", "0",
            "What is the capital of France?",
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-4000:]
    assert "Paris" in cli.stdout

    for metadata in (None, [("authorization", "Bearer not-the-key-but-long-enough")]):
        with Client(address, timeout=30, credentials=tls, metadata=metadata) as client:
            with pytest.raises(SplitserveError) as refused:
                client.generate(prompt="Hello", max_tokens=4)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED, metadata

    serving = health_pb2.HealthCheckResponse.SERVING
    # Health needs no key on the client port.
    with grpc.secure_channel(address, tls) as channel:
        assert health_check(channel) == serving
    # The plaintext client API is gone.
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as refused_plain:
            health_check(channel)
        assert refused_plain.value.code() == grpc.StatusCode.UNAVAILABLE

    # The Planner API: mutual TLS, so the planner token its front-end sends is read by no one
    # else, and only a front-end with the CA's client certificate gets to send one.
    planner = f"127.0.0.1:{stand_ins.ports[50053]}"
    with grpc.insecure_channel(planner) as channel:
        with pytest.raises(grpc.RpcError) as refused_plain_planner:
            health_check(channel)
        assert refused_plain_planner.value.code() == grpc.StatusCode.UNAVAILABLE
    demands_client_certificate(planner, tls, stand_ins.certs, "frontend-client")

    # The executor: the scheduler's client certificate gets in, TLS alone does not.
    demands_client_certificate(f"127.0.0.1:{stand_ins.ports[50052]}", tls, stand_ins.certs, "scheduler-client")

    # The gateway passes the caller's key on: without it the scheduler refuses, with it answers.
    models = f"http://127.0.0.1:{stand_ins.ports[8000]}/v1/models"
    with pytest.raises(urllib.error.HTTPError) as unauthorized:
        urllib.request.urlopen(models, timeout=30)
    assert unauthorized.value.code == 401
    keyed = urllib.request.Request(models, headers={"authorization": f"Bearer {key}"})
    with urllib.request.urlopen(keyed, timeout=30) as reply:
        assert json.loads(reply.read())["data"][0]["id"] == "SmolLM2-135M-Instruct"

    statuses = running.stop()
    assert statuses == {"gateway": 0, "frontend": 0, "planner": 0, "executor": 0}
