"""SamplingParams.structured_output (proto) -> GrammarSpec, with a clear error naming the field."""
from __future__ import annotations

from services.common.errors import InvalidArgument
from services.decoder.grammar.spec import PARAM, GrammarSpec
from services.decoder.server.validation import Limits, check_constraint_size


def grammar_spec(sampling, limits: Limits) -> GrammarSpec | None:
    """The constraint of a decoder_pb2.SamplingParams, or None when it has none.

    Raises TooLarge (param structured_output) for a text past its limit (validation.py), before it is
    parsed; InvalidArgument (param structured_output): no kind set, json_object false, or what GrammarSpec
    refuses (an empty choice, a schema that is not a JSON object or uses a keyword that cannot be
    enforced). Whether it compiles, within the deadline, is the compiler's to say.
    """
    if not sampling.HasField("structured_output"):
        return None
    so = sampling.structured_output
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("structured_output sets no constraint: give one of json_schema, json_object, regex, "
                              "choice or grammar", param=PARAM)
    check_constraint_size(so, limits)
    if kind == "json_schema":
        return GrammarSpec.json_schema(so.json_schema)
    if kind == "json_object":
        if not so.json_object:
            raise InvalidArgument("json_object must be true when set", param=PARAM)
        return GrammarSpec.json_object()
    if kind == "regex":
        return GrammarSpec.regex(so.regex)
    if kind == "choice":
        return GrammarSpec.choice(list(so.choice.choices))
    return GrammarSpec.grammar(so.grammar)
