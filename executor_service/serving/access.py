"""Who may call this executor's API (ExecutorInfo.access): under mutual TLS, a certificate whose
common name is allowed; with a token file, callers that send the token; with
--insecure-executor, anyone. Checked on Describe and Execute before anything else, and on
KvTransfer (whose callers are other executors) without the names."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import grpc

from protos.executor_access import EXECUTOR_TOKEN_METADATA, INSECURE_ACCESS
from service_support.transport_security import peer_certificate_name


@dataclass(slots=True, frozen=True)
class Refusal:
    code: grpc.StatusCode
    message: str


@dataclass(slots=True, frozen=True)
class ExecutorAccess:
    # The shared secret callers must send, when a token file was given.
    token: str | None = None
    # Under mutual TLS: the certificate common names that may call; None under plain or
    # server-only TLS, where certificates name nobody.
    allowed_names: frozenset[str] | None = None
    # --insecure-executor: no check at all, chosen explicitly.
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.insecure == (self.token is not None or self.allowed_names is not None):
            raise ValueError("an executor is either insecure or checks a token or certificate names")

    @property
    def mode(self) -> str:
        if self.insecure:
            return INSECURE_ACCESS
        modes = (["mutual-tls"] if self.allowed_names is not None else []) + (["token"] if self.token else [])
        return "+".join(modes)

    @classmethod
    def from_flags(
        cls, token: str | None, insecure: bool, allowed_names: str, mutual_tls: bool
    ) -> ExecutorAccess:
        """The policy the command line asks for; ValueError when it leaves the executor open
        without saying so, or says two things at once."""
        if insecure:
            if token is not None or mutual_tls:
                raise ValueError(
                    "--insecure-executor turns every check off; it cannot go with "
                    "--executor-token-file or --tls-client-ca"
                )
            return cls(insecure=True)
        names = frozenset(name.strip() for name in allowed_names.split(",") if name.strip())
        if mutual_tls and not names:
            raise ValueError("--allowed-scheduler-names names no scheduler")
        if not mutual_tls and token is None:
            raise ValueError(
                "an executor is closed by default: give it --executor-token-file FILE (and the "
                "scheduler the same file), or mutual TLS (--tls-cert, --tls-key, --tls-client-ca); "
                "--insecure-executor opens it to anyone who reaches its port"
            )
        return cls(token=token, allowed_names=names if mutual_tls else None)

    def refusal(self, context: grpc.aio.ServicerContext) -> Refusal | None:
        """Why this call may not proceed, or None. Neither the expected token nor the allowed
        names, nor who holds the executor, is ever told to the caller."""
        if self.allowed_names is not None and peer_certificate_name(context) not in self.allowed_names:
            return Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                "this executor serves only schedulers whose certificate names it allows "
                "(--allowed-scheduler-names); this certificate's name is not one",
            )
        return self._token_refusal(
            context,
            "this executor takes plans only from schedulers that send its token: start the "
            "scheduler with --executor-token-file naming the executor's token file",
        )

    def peer_refusal(self, context: grpc.aio.ServicerContext) -> Refusal | None:
        """refusal() for a call from another executor (KvTransfer.FetchBlocks): the token where
        one is set, but not the allowed scheduler names, which executors' certificates do not
        carry. Under mutual TLS the handshake has already required a certificate the client CA
        signed; the transfer id, a secret only the holding scheduler and the destination know,
        is what names the blocks."""
        return self._token_refusal(
            context,
            "this executor sends K/V only to executors that send its token: give every executor "
            "the same --executor-token-file",
        )

    def _token_refusal(self, context: grpc.aio.ServicerContext, message: str) -> Refusal | None:
        if self.token is None:
            return None
        sent = dict(context.invocation_metadata() or ()).get(EXECUTOR_TOKEN_METADATA, "")
        # Compared in constant time over bytes, so timing tells nothing of a near miss.
        if hmac.compare_digest(str(sent).encode(), self.token.encode()):
            return None
        return Refusal(grpc.StatusCode.UNAUTHENTICATED, message)
