"""StructuredOutput between the client protocol's message and the core's record."""

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.structured_output import GrammarKind, StructuredOutput


def spec_from_proto(message: pb.SamplingParams) -> StructuredOutput | None:
    """The request's grammar, or None when it asks for none; RequestRejected when the message
    sets the field but no kind, or json_object to false."""
    if not message.HasField("structured_output"):
        return None
    field = message.structured_output
    kind = field.WhichOneof("kind")
    if kind is None:
        raise RequestRejected(ErrorKind.INVALID, "structured_output is set but names no kind of grammar")
    if kind == "json_object":
        if not field.json_object:
            raise RequestRejected(ErrorKind.INVALID, "structured_output json_object must be true when set")
        return StructuredOutput(GrammarKind.JSON_OBJECT)
    if kind == "choice":
        return StructuredOutput(GrammarKind.CHOICE, choices=tuple(field.choice.choices))
    return StructuredOutput(GrammarKind(kind), source=getattr(field, kind))


def spec_to_proto(spec: StructuredOutput) -> pb.StructuredOutput:
    if spec.kind is GrammarKind.JSON_OBJECT:
        return pb.StructuredOutput(json_object=True)
    if spec.kind is GrammarKind.CHOICE:
        return pb.StructuredOutput(choice=pb.Choices(choices=spec.choices))
    return pb.StructuredOutput(**{spec.kind.value: spec.source})
