"""One-shot certificates and API key for the secured setup (docker-compose.secure.yml).

    python deploy/make_certs.py OUT_DIR [--executor-name NAME ...] [--scheduler-name NAME ...]
                                [--planner-name NAME ...] [--days N] [--service-owner UID:GID]

Writes into OUT_DIR a private CA (ca.pem, ca-key.pem); the scheduler's client-API server
certificate (scheduler.pem, scheduler-key.pem), the planners' Planner API server certificate
(planner.pem, planner-key.pem) and the executors' server certificate (executor.pem,
executor-key.pem), each for its given names plus localhost and 127.0.0.1; the client
certificate the scheduler presents to executors (scheduler-client.pem, scheduler-client-key.pem,
CN splitserve-scheduler, clientAuth); the client certificate executors present to each other
when they fetch K/V (executor-peer.pem, executor-peer-key.pem, CN splitserve-executor-peer,
clientAuth: a name no executor allows to drive it); the client certificate front-ends present to
planners (frontend-client.pem, frontend-client-key.pem, CN splitserve-frontend, clientAuth: a
planner started with --tls-client-ca ca.pem takes no front-end without it); and one random API
key, in api-keys (the scheduler's --api-key-file) and client-api-key (the client's). Private
keys and key files are mode 0600.

Idempotent: whatever is present, signed by the CA, matching its key, naming what was asked for
and valid for more than a day is kept; only the rest is made again (a new CA reissues every
certificate). Logs one `event=... key=value` line per step to stderr; the exit status says
whether it worked.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import secrets
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The name executors allow by default (--allowed-scheduler-names).
from protos.executor_access import DEFAULT_SCHEDULER_NAME

logger = logging.getLogger("make_certs")

# The executor takes the common name of the client certificate as the scheduler's identity, and
# an executor serves one scheduler at a time: a CN that changed on every reissue would make a
# restarted scheduler a stranger to its own executors until their lease ran out.
SCHEDULER_IDENTITY = DEFAULT_SCHEDULER_NAME
# What executors present to each other (--tls-peer-cert): the CA signs it, so a peer's
# KvTransfer lets it in, but it is no scheduler name, so no executor takes plans from it.
EXECUTOR_PEER_NAME = "splitserve-executor-peer"
# What front-ends present to planners (--planner-tls-cert), which the planners' --tls-client-ca
# checks; the planner logs it with each front-end that connects.
FRONTEND_IDENTITY = "splitserve-frontend"
CA_NAME = "splitserve private CA"
LOCAL_NAMES = ("localhost", "127.0.0.1")
# Certificates this close to expiry are made again, so a restart never picks up one that lapses
# before the next restart.
RENEW_BEFORE = datetime.timedelta(days=1)
# Backdated start: a container clock a little behind the one that issued must still accept it.
CLOCK_SKEW = datetime.timedelta(hours=1)
PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644
API_KEYS = "api-keys"
CLIENT_API_KEY = "client-api-key"


@dataclass(frozen=True, slots=True)
class LeafSpec:
    """One certificate the CA issues: its file stem, subject and what it may be used for."""

    stem: str
    common_name: str
    names: tuple[str, ...]
    usage: x509.ObjectIdentifier

    @property
    def cert_file(self) -> str:
        return f"{self.stem}.pem"

    @property
    def key_file(self) -> str:
        return f"{self.stem}-key.pem"


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A certificate and its private key (the CA's, or a leaf's)."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def leaf_specs(
    executor_names: Sequence[str], scheduler_names: Sequence[str], planner_names: Sequence[str] = ()
) -> list[LeafSpec]:
    def with_local(names: Sequence[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*names, *LOCAL_NAMES]))

    return [
        LeafSpec(
            "scheduler",
            "splitserve-scheduler-api",
            with_local(scheduler_names),
            ExtendedKeyUsageOID.SERVER_AUTH,
        ),
        LeafSpec(
            "planner",
            "splitserve-planner",
            with_local(planner_names),
            ExtendedKeyUsageOID.SERVER_AUTH,
        ),
        LeafSpec(
            "executor",
            "splitserve-executor",
            with_local(executor_names),
            ExtendedKeyUsageOID.SERVER_AUTH,
        ),
        LeafSpec("scheduler-client", SCHEDULER_IDENTITY, (), ExtendedKeyUsageOID.CLIENT_AUTH),
        LeafSpec("executor-peer", EXECUTOR_PEER_NAME, (), ExtendedKeyUsageOID.CLIENT_AUTH),
        LeafSpec("frontend-client", FRONTEND_IDENTITY, (), ExtendedKeyUsageOID.CLIENT_AUTH),
    ]


# --- files -----------------------------------------------------------------------------------


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Readers (a service restarting meanwhile) see the old file or the new one, never half;
    a key file is never readable by others, not even for a moment."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    logger.info("event=file_written path=%s mode=%o", path, mode)


def read_optional(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_atomically(path, pem, PRIVATE_MODE)


def write_cert(path: Path, cert: x509.Certificate) -> None:
    write_atomically(path, cert.public_bytes(serialization.Encoding.PEM), PUBLIC_MODE)


def load_pair(out: Path, cert_file: str, key_file: str) -> KeyPair | None:
    """The certificate and key stored under these names, or None when either is missing or
    unreadable, or they do not belong together."""
    cert_pem, key_pem = read_optional(out / cert_file), read_optional(out / key_file)
    if cert_pem is None or key_pem is None:
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError:
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not same_key(cert, key):
        return None
    return KeyPair(cert, key)


def same_key(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    # A crash between writing a key and its certificate leaves a pair that does not match.
    der = serialization.Encoding.DER
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    return cert.public_key().public_bytes(der, spki) == key.public_key().public_bytes(der, spki)


# --- certificates ----------------------------------------------------------------------------


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def still_valid(cert: x509.Certificate) -> bool:
    moment = now()
    return cert.not_valid_before_utc <= moment and cert.not_valid_after_utc - moment > RENEW_BEFORE


def subject_alternative_names(names: Sequence[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def cert_names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return ips | set(san.get_values_for_type(x509.DNSName))


def cert_usages(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    try:
        return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return set()


def common_name(cert: x509.Certificate) -> str:
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def builder_for(
    subject: str, issuer: x509.Name | None, key: ec.EllipticCurvePrivateKey, days: int
) -> x509.CertificateBuilder:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    start = now() - CLOCK_SKEW
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + CLOCK_SKEW + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def make_ca(days: int) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        builder_for(CA_NAME, None, key, days)
        # path_length=0: the CA signs only leaf certificates, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert, key)


def make_leaf(spec: LeafSpec, ca: KeyPair, days: int) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        builder_for(spec.common_name, ca.cert.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        # One purpose each: a leaked server certificate cannot log in to an executor.
        .add_extension(x509.ExtendedKeyUsage([spec.usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if spec.names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(subject_alternative_names(spec.names)), critical=False
        )
    return KeyPair(builder.sign(ca.key, hashes.SHA256()), key)


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def leaf_is_current(leaf: KeyPair | None, spec: LeafSpec, ca: KeyPair) -> bool:
    return (
        leaf is not None
        and still_valid(leaf.cert)
        and issued_by(leaf.cert, ca.cert)
        and common_name(leaf.cert) == spec.common_name
        and set(spec.names) <= cert_names(leaf.cert)
        and cert_usages(leaf.cert) == {spec.usage}
    )


def ensure_ca(out: Path, days: int) -> tuple[KeyPair, bool]:
    """The CA, and whether it is new (then every certificate it signed goes too)."""
    ca = load_pair(out, "ca.pem", "ca-key.pem")
    if ca is not None and still_valid(ca.cert):
        return ca, False
    ca = make_ca(days)
    # Key first: a crash between the two leaves a pair load_pair rejects, not a CA without key.
    write_key(out / "ca-key.pem", ca.key)
    write_cert(out / "ca.pem", ca.cert)
    logger.info("event=ca_issued not_after=%s", ca.cert.not_valid_after_utc.isoformat())
    return ca, True


def ensure_leaf(out: Path, spec: LeafSpec, ca: KeyPair, days: int) -> bool:
    """Issues the certificate unless a current one is there; True when it issued one."""
    if leaf_is_current(load_pair(out, spec.cert_file, spec.key_file), spec, ca):
        return False
    leaf = make_leaf(spec, ca, days)
    write_key(out / spec.key_file, leaf.key)
    write_cert(out / spec.cert_file, leaf.cert)
    logger.info(
        "event=cert_issued file=%s cn=%s names=%s not_after=%s",
        spec.cert_file,
        spec.common_name,
        ",".join(spec.names) or "-",
        leaf.cert.not_valid_after_utc.isoformat(),
    )
    return True


# --- API key ---------------------------------------------------------------------------------


def ensure_api_key(out: Path) -> bool:
    """One random bearer token, in the scheduler's key file and the client's; True when new."""
    keys, client = read_optional(out / API_KEYS), read_optional(out / CLIENT_API_KEY)
    if keys is not None and client is not None:
        token = client.decode(errors="replace").strip()
        if token and token in keys.decode(errors="replace").split():
            return False
    token = secrets.token_urlsafe(32)
    # The scheduler's file first: a crash then leaves a client key the scheduler does not know,
    # which the next run replaces, rather than the other way round.
    write_atomically(out / API_KEYS, f"{token}\n".encode(), PRIVATE_MODE)
    write_atomically(out / CLIENT_API_KEY, f"{token}\n".encode(), PRIVATE_MODE)
    logger.info("event=api_key_issued")
    return True


# --- ownership -------------------------------------------------------------------------------


def written_files(specs: Sequence[LeafSpec]) -> list[str]:
    leaves = [name for spec in specs for name in (spec.cert_file, spec.key_file)]
    return ["ca.pem", "ca-key.pem", *leaves, API_KEYS, CLIENT_API_KEY]


def service_files(specs: Sequence[LeafSpec]) -> set[str]:
    """What the servers read and no one else needs: their keys and the accepted API keys."""
    return {API_KEYS, *(spec.key_file for spec in specs)}


def settle_owners(out: Path, specs: Sequence[LeafSpec], service_owner: tuple[int, int]) -> None:
    """Run as root in a container writing a host folder: the services (another user) must read
    their keys, and the host user who made the folder the CA and the client key. So service
    files go to service_owner, the rest to the folder's owner; other files are not ours."""
    folder = out.stat()
    ours = service_files(specs)
    for name in written_files(specs):
        path = out / name
        uid, gid = service_owner if name in ours else (folder.st_uid, folder.st_gid)
        stat = path.stat()
        if (stat.st_uid, stat.st_gid) != (uid, gid):
            os.chown(path, uid, gid)
            logger.info("event=owner_set path=%s uid=%d gid=%d", path, uid, gid)


# --- main ------------------------------------------------------------------------------------


def make_certs(
    out: Path,
    executor_names: Sequence[str],
    scheduler_names: Sequence[str],
    days: int,
    service_owner: tuple[int, int] | None = None,
    planner_names: Sequence[str] = (),
) -> int:
    """Brings OUT_DIR up to date; returns how many certificates and keys it (re)issued."""
    out.mkdir(parents=True, exist_ok=True)
    specs = leaf_specs(executor_names, scheduler_names, planner_names)
    ca, new_ca = ensure_ca(out, days)
    issued = int(new_ca)
    for spec in specs:
        issued += ensure_leaf(out, spec, ca, days)
    issued += ensure_api_key(out)
    if service_owner is not None:
        settle_owners(out, specs, service_owner)
    if issued:
        logger.info("event=certs_ready out=%s issued=%d", out, issued)
    else:
        logger.info("event=certs_unchanged out=%s reason=all_present_and_valid", out)
    return issued


def owner(text: str) -> tuple[int, int]:
    uid, _, gid = text.partition(":")
    return int(uid), int(gid or uid)


def lifetime_days(text: str) -> int:
    days = int(text)
    if days < 2:
        # Anything shorter is renewed on every run (see RENEW_BEFORE).
        raise argparse.ArgumentTypeError("at least 2 days")
    return days


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_certs", description=__doc__.splitlines()[0])
    parser.add_argument("out", metavar="OUT_DIR", type=Path)
    parser.add_argument(
        "--executor-name",
        action="append",
        default=[],
        metavar="NAME",
        help="DNS name or IP the scheduler dials executors by (repeat); localhost and 127.0.0.1 "
        "are always included",
    )
    parser.add_argument(
        "--scheduler-name",
        action="append",
        default=[],
        metavar="NAME",
        help="DNS name or IP clients dial the scheduler by (repeat); localhost and 127.0.0.1 "
        "are always included",
    )
    parser.add_argument(
        "--planner-name",
        action="append",
        default=[],
        metavar="NAME",
        help="DNS name or IP front-ends dial the planners by, or check them as "
        "(--planner-tls-server-name) (repeat); localhost and 127.0.0.1 are always included",
    )
    parser.add_argument(
        "--days", type=lifetime_days, default=365, help="validity of new certificates"
    )
    parser.add_argument(
        "--service-owner",
        type=owner,
        metavar="UID:GID",
        help="(as root) give the services' keys to this user and every other file to OUT_DIR's "
        "owner",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    try:
        make_certs(args.out, args.executor_name, args.scheduler_name, args.days, args.service_owner, args.planner_name)
    except OSError as error:
        logger.error("event=certs_failed out=%s error=%r", args.out, error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
