"""The one model this gateway serves: its name, and the check of a request's `model` field."""

from __future__ import annotations

from dataclasses import dataclass

from clients.async_client import AsyncClient
from clients.openai_gateway.errors import GatewayError
from protos.splitserve.v1 import generation_pb2 as pb


@dataclass(slots=True)
class ServedModel:
    client: AsyncClient
    # --served-model-name; None serves the model under the executor's model_id.
    configured_name: str | None
    # The model_id once a GetModelInfo answered (the scheduler serves one model for its life).
    _model_id: str | None = None

    async def info(self, api_key: str | None) -> pb.ModelInfo:
        info = await self.client.model_info(api_key=api_key)
        self._model_id = info.model_id
        return info

    def name(self, info: pb.ModelInfo) -> str:
        return self.configured_name or info.model_id

    async def resolve(self, requested: str | None, api_key: str | None) -> str:
        """The served name, for a request that named `requested` (None: the served one).

        Raises 404 model_not_found for another name, but only after the scheduler accepted the
        caller's key, so that callers without a valid key cannot probe which names exist.
        """
        name = self.configured_name or self._model_id
        checked = False
        if name is None:
            name = self.name(await self.info(api_key))
            checked = True
        if requested is None or requested == name:
            return name
        if not checked:
            await self.info(api_key)
        raise GatewayError(
            404,
            f"The model `{requested}` does not exist.",
            param="model",
            code="model_not_found",
            error_type="invalid_request_error",
        )
