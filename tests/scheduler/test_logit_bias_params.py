"""logit_bias and allowed_token_ids on their way from a client's request to the executor: checked
once against the vocab and OpenAI's range, kept through the front-end's hand-over to a planner, and
given to the executor as the pairs the client sent."""

from __future__ import annotations

import math

import pytest

from executor_service.sampling.sampler_settings import SamplerSettings
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.sampling_params import SamplingDefaults
from scheduler_service.frontend.request_intake import sampling_from_proto
from scheduler_service.planner.plan_codec import sampler_config
from scheduler_service.tier.request_codec import sampling_to_proto

VOCAB = 100


def _params(**fields: object) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, **fields)


def test_the_pairs_reach_the_executor_as_the_client_sent_them() -> None:
    message = _params(logit_bias={40: 5.0, 7: -100.0, 12: 0.5}, allowed_token_ids=[7, 12, 40, 41])
    params = sampling_from_proto(message, SamplingDefaults())
    assert params.problems(VOCAB, max_logprobs=5) == []
    # A front-end hands the request to a planner, which parses it again.
    handed_over = sampling_from_proto(sampling_to_proto(params), SamplingDefaults())
    assert handed_over == params
    settings = SamplerSettings.from_proto(sampler_config(handed_over))
    assert dict(settings.logit_bias) == {40: 5.0, 7: -100.0, 12: 0.5}
    assert settings.allowed_token_ids == (7, 12, 40, 41)
    assert settings.shapes_logits and not SamplerSettings().shapes_logits


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias names token 100, outside the vocab [0, 100)"),
        ({"logit_bias": {3: 100.5}}, "logit_bias values must be in [-100, 100], got 100.5"),
        ({"logit_bias": {3: math.inf}}, "logit_bias values must be in [-100, 100], got inf"),
        ({"logit_bias": {3: math.nan}}, "logit_bias values must be in [-100, 100], got nan"),
        ({"allowed_token_ids": [3, VOCAB]}, "allowed_token_ids names token 100, outside the vocab [0, 100)"),
    ],
)
def test_a_bias_or_allowed_id_the_model_cannot_take_is_refused_naming_it(fields: dict[str, object], problem: str) -> None:
    params = sampling_from_proto(_params(**fields), SamplingDefaults())
    assert params.problems(VOCAB, max_logprobs=5) == [problem]
