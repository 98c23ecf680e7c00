import os
import subprocess
import sys

import pytest

from services.decoder.engine.hashing import encode_key, extend_block_hashes, hash_block
from services.decoder.engine.request import Request
from services.decoder.engine.step import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _request(tokens, extra=(), spans=()):
    return Request("r", tokens, SamplingParams(), arrival_seq=0, extra_keys=extra, span_keys=spans)


def test_hash_is_stable_across_processes():
    code = ("from services.decoder.engine.hashing import hash_block;"
            "print(hash_block(None, [1, 2, 3], ('adapter', b'\\x00', 7, ('x', None))).hex())")
    outs = set()
    for seed in ("0", "1"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    here = hash_block(None, [1, 2, 3], ("adapter", b"\x00", 7, ("x", None))).hex()
    assert outs == {here}


def test_each_input_changes_the_hash():
    base = hash_block(None, [1, 2], ("a",))
    assert hash_block(None, [1, 2], ("a",)) == base
    assert hash_block(b"p" * 32, [1, 2], ("a",)) != base
    assert hash_block(None, [2, 1], ("a",)) != base
    assert hash_block(None, [1, 2], ("b",)) != base
    assert hash_block(None, [1, 2], ()) != base
    assert hash_block(None, [1, 2], ("a",), [(0, 2, "img")]) != base


def test_encoding_keeps_types_and_boundaries_apart():
    keys = [1, "1", b"1", True, 1.0, None, (1,), ("ab", "c"), ("a", "bc"), (), ((),)]
    assert len({encode_key(k) for k in keys}) == len(keys)


def test_unencodable_key_is_refused():
    with pytest.raises(TypeError):
        encode_key(("x", object()))
    with pytest.raises(TypeError):
        hash_block(None, [1], ({"a": 1},))


def test_chain_hashes_only_full_blocks_and_extends_incrementally():
    req = _request([1, 2, 3, 4, 5, 6, 7])
    hashes = extend_block_hashes(req, 3)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, [1, 2, 3], ())
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6], ())
    req.append_output(8)
    req.append_output(9)
    assert extend_block_hashes(req, 3)[:2] == hashes[:2]
    assert len(req.block_hashes) == 3


def test_span_keys_salt_only_overlapping_blocks():
    tokens = list(range(1, 13))
    plain = extend_block_hashes(_request(tokens), 4)
    a = extend_block_hashes(_request(tokens, spans=((4, 6, "image-a"),)), 4)
    b = extend_block_hashes(_request(tokens, spans=((4, 6, "image-b"),)), 4)
    assert a[0] == b[0] == plain[0]          # text before the image is shared
    assert a[1] != b[1] and a[2] != b[2]     # the image block and everything after it are not
    assert a[1] != plain[1]


def test_extra_keys_salt_every_block():
    tokens = list(range(1, 9))
    a = extend_block_hashes(_request(tokens, extra=("lora", "digest-a")), 4)
    b = extend_block_hashes(_request(tokens, extra=("lora", "digest-b")), 4)
    assert not set(a) & set(b)
