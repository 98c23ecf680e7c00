"""Images through the decoder service over real gRPC: rows travel as Tensors, output equals the in-process
engine, refusals are clear INVALID_ARGUMENT errors and the service keeps serving after them."""
from __future__ import annotations

import grpc
import pytest

from services.common.errors import REASON_KEY
from services.common.pb import common_pb2, decoder_pb2, decoder_pb2_grpc
from services.common.tensors import to_proto
from tests.decoder.idle import wait_idle
from tests.decoder.multimodal.conftest import photo
from tests.decoder.multimodal.helpers import encode_images, greedy, make_core, messages, our_prompt, run
from tests.loops import LoopThread

D = decoder_pb2
NEW = 6
MAX_LEN = 200
TEXT = "Describe it."
LONG_TEXT = "Describe both pictures in detail, please."


@pytest.fixture(scope="module")
def images(encoder):
    """Our vision encoder's output for two photos: the cat (6x9 rows) and the astronaut (8x8)."""
    return encode_images(encoder, [photo("chelsea.png"), photo("astronaut.png")])


@pytest.fixture(scope="module")
def server(vl_ckpt):
    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.decoder.server.service import start
    loop = LoopThread()
    cfg = DecoderConfig(model=str(vl_ckpt), num_blocks=128, block_size=4, max_num_batched_tokens=32,
                        max_model_len=MAX_LEN, max_images=2, max_loras=0, fast_paths="screen=on")
    srv, servicer = loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0), cfg))
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)
    loop.run(srv.stop(0))
    assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()


def image_msg(image, **override) -> D.ImageInput:
    t, h, w = override.pop("grid", image.grid)
    msg = D.ImageInput(rows=override.pop("rows", to_proto(image.rows)), grid=common_pb2.Grid(t=t, h=h, w=w),
                       content_hash=override.pop("content_hash", image.content_hash))
    assert not override
    return msg


def image_chat(indices, imgs, text=TEXT, max_tokens=NEW) -> D.GenerateRequest:
    parts = [D.ContentPart(image_index=i) for i in indices] + [D.ContentPart(text=text)]
    return D.GenerateRequest(
        chat=D.ChatMessages(messages=[D.ChatMessage(role="user", content=parts)], add_generation_prompt=True),
        images=imgs, sampling=D.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def generate(stub, req):
    tokens, usage = [], None
    for msg in stub.Generate(req):
        tokens.extend(msg.token_ids)
        if msg.HasField("usage"):
            usage = msg.usage
    return tokens, usage


def test_expansion_alone_crosses_the_context_limit(vl_ckpt, images):
    """What the expanded_past_context refusal relies on: unexpanded it fits, expanded it does not."""
    vp = our_prompt(vl_ckpt, messages(LONG_TEXT, 2), images)
    placeholders = len(vp.token_ids) - sum(im.num_rows for im in images) + len(images)
    assert placeholders < MAX_LEN <= len(vp.token_ids)


def test_model_info_says_images(server):
    assert server.GetModelInfo(D.GetModelInfoRequest()).supports_images


def test_image_chat_equals_in_process_and_hits_the_prefix_cache(server, vl_ckpt, images):
    cat = images[0]
    vp = our_prompt(vl_ckpt, messages(TEXT, 1), [cat])
    want = run(make_core(vl_ckpt), {"x": vp}, greedy(NEW))["x"].tokens
    tokens, usage = generate(server, image_chat([0], [image_msg(cat)]))
    assert tokens == want
    assert usage.prompt_tokens == len(vp.token_ids)           # expanded: one position per image row
    again, usage2 = generate(server, image_chat([0], [image_msg(cat)]))
    assert again == want and usage2.cached_tokens >= vp.spans[0][1]
    # Two images, placed in the order the parts name them (image_index 1 first).
    vp2 = our_prompt(vl_ckpt, messages(TEXT, 2), [images[1], cat])
    want2 = run(make_core(vl_ckpt), {"y": vp2}, greedy(2))["y"].tokens
    got2, _ = generate(server, image_chat([1, 0], [image_msg(cat), image_msg(images[1])], max_tokens=2))
    assert got2 == want2
    wait_idle(server)


def refusals(images):
    cat, astro = images
    rows = cat.rows
    text_prompt = D.GenerateRequest(text="hi", images=[image_msg(cat)], sampling=D.SamplingParams(max_tokens=2))
    smuggled = D.GenerateRequest(text="look <|image_pad|>", sampling=D.SamplingParams(max_tokens=2))
    return {
        "part_without_image": (image_chat([0], []), "INVALID_ARGUMENT", "out of range"),
        "image_without_part": (image_chat([0], [image_msg(cat), image_msg(astro)]), "INVALID_ARGUMENT",
                               "exactly once"),
        "same_image_twice": (image_chat([0, 0], [image_msg(cat)]), "INVALID_ARGUMENT", "exactly once"),
        "too_many_images": (image_chat([0, 1, 2], [image_msg(cat)] * 3), "TOO_LARGE", "at most 2"),
        "rows_for_another_grid": (image_chat([0], [image_msg(cat, grid=(1, 8, 8))]), "INVALID_ARGUMENT",
                                  "grid"),
        "rows_of_another_width": (image_chat([0], [image_msg(cat, rows=to_proto(rows[:, :32].contiguous()))]),
                                  "INVALID_ARGUMENT", "does not match"),
        "rows_bytes_truncated": (image_chat([0], [image_msg(cat, rows=common_pb2.Tensor(
            data=to_proto(rows).data[:-4], dtype=common_pb2.DTYPE_FLOAT32, shape=list(rows.shape)))]),
            "INVALID_ARGUMENT", "bytes"),
        "rows_float16": (image_chat([0], [image_msg(cat, rows=to_proto(rows.half()))]), "INVALID_ARGUMENT",
                         "float32"),
        "zero_grid": (image_chat([0], [image_msg(cat, grid=(1, 0, 9))]), "INVALID_ARGUMENT", ">= 1"),
        "video_grid": (image_chat([0], [image_msg(cat, grid=(2, 3, 9))]), "UNSUPPORTED", "single-frame"),
        "empty_hash": (image_chat([0], [image_msg(cat, content_hash="")]), "INVALID_ARGUMENT", "content_hash"),
        "images_with_a_text_prompt": (text_prompt, "INVALID_ARGUMENT", "chat prompt"),
        "placeholder_without_image": (smuggled, "INVALID_ARGUMENT", "placeholder"),
        # 2 placeholders fit easily; expanded to 54 + 64 rows they do not (expansion precedes the check).
        "expanded_past_context": (image_chat([0, 1], [image_msg(cat), image_msg(astro)], text=LONG_TEXT,
                                             max_tokens=1), "CONTEXT_LENGTH", "maximum context length"),
    }


REFUSALS = ("part_without_image", "image_without_part", "same_image_twice", "too_many_images",
            "rows_for_another_grid", "rows_of_another_width", "rows_bytes_truncated", "rows_float16", "zero_grid",
            "video_grid", "empty_hash", "images_with_a_text_prompt", "placeholder_without_image",
            "expanded_past_context")


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_are_invalid_argument_and_the_service_stays_up(server, images, case):
    cases = refusals(images)
    assert sorted(cases) == sorted(REFUSALS)
    req, reason, text = cases[case]
    with pytest.raises(grpc.RpcError) as info:
        list(server.Generate(req))
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert dict(err.trailing_metadata() or ()).get(REASON_KEY) == reason
    assert text in err.details()
    wait_idle(server)
    tokens, _ = generate(server, image_chat([0], [image_msg(images[0])], max_tokens=1))
    assert len(tokens) == 1
