"""vLLM's /tokenize, /detokenize and /version, with vLLM's request and response shapes, over the
scheduler's Tokenize and Detokenize calls (the same tokenizer and chat template Generate uses).

Options vLLM takes that this server cannot honour are refused by name: a caller's own chat
template, continuing the final message, and adding special tokens other than as Generate does (to a
prompt, yes; on top of a chat template, no). Tools are rendered as a chat completion with
tool_choice auto renders them.
"""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from clients.openai_gateway.errors import bad_request, unsupported
from clients.openai_gateway.schemas import DetokenizeRequest, TokenizeRequest
from clients.openai_gateway.state import ApiKey, GatewayDep
from clients.openai_gateway.translate import chat_messages, template_kwargs

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, gateway: GatewayDep, api_key: ApiKey) -> JSONResponse:
    _check_tokenize(body)
    await gateway.model.resolve(body.model, api_key)
    client = gateway.client
    try:
        if body.messages is not None:
            variables = body.chat_template_kwargs
            result = await client.tokenize(
                messages=chat_messages(body.messages),
                add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=None if variables is None else template_kwargs(variables),
                tools=body.tools,
                api_key=api_key,
            )
        else:
            result = await client.tokenize(body.prompt, api_key=api_key)
    except ValueError as error:
        raise bad_request(str(error)) from None
    info = await gateway.model.info(api_key)
    return JSONResponse(
        {
            "count": len(result.token_ids),
            "max_model_len": info.max_model_len,
            "tokens": result.token_ids,
            "token_strs": result.tokens if body.return_token_strs else None,
        }
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, gateway: GatewayDep, api_key: ApiKey) -> JSONResponse:
    await gateway.model.resolve(body.model, api_key)
    try:
        # Special tokens stay in the text, as vLLM's /detokenize writes them.
        text = await gateway.client.detokenize(body.tokens, api_key=api_key)
    except ValueError as error:
        raise bad_request(str(error), "tokens") from None
    return JSONResponse({"prompt": text})


@router.get("/version")
async def version() -> JSONResponse:
    try:
        installed = metadata.version("splitserve")
    except metadata.PackageNotFoundError:
        # Run from a checkout that was never installed: no version to tell.
        installed = "unknown"
    return JSONResponse({"version": installed})


def _check_tokenize(body: TokenizeRequest) -> None:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    chat = body.messages is not None
    if body.add_special_tokens is not None and body.add_special_tokens != (not chat):
        why = (
            "true is not supported with messages (the chat template writes the special tokens)"
            if chat
            else "false is not supported for a prompt (the tokenizer's are always added, as Generate adds them)"
        )
        raise unsupported("add_special_tokens", f"add_special_tokens={why}")
    if not chat:
        extras = ("chat_template_kwargs", body.chat_template_kwargs), ("tools", body.tools)
        for name, value in extras:
            if value is not None:
                raise bad_request(f"{name} needs messages", name)
    if body.chat_template is not None:
        raise unsupported("chat_template", "a caller's own chat_template is not supported")
    if body.continue_final_message:
        raise unsupported("continue_final_message", "continue_final_message is not supported")
