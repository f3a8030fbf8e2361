"""pinlab.copyargs: the one parser of copy calls (issue 31). Every form torch accepts, positional and keyword;
and every interception site reads a call through it (a test that greps the sites, so that a sixth parser does
not grow back)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pinlab.copyargs import CopyCall, copy_call, cuda_args, device_type, parse_to_args, to_args

LIB = Path(__file__).resolve().parents[1] / "lib" / "pinlab"
x = torch.zeros(3)
y = torch.zeros(3, dtype=torch.int16)


@pytest.mark.parametrize("rest, kwargs, expected", [
    (("cuda",), {}, ("cuda", None, False, False)),
    (("cuda", torch.float16, True), {}, ("cuda", torch.float16, True, False)),
    (("cuda", torch.float16, True, True), {}, ("cuda", torch.float16, True, True)),
    (("cuda", None, True), {}, ("cuda", None, True, False)),
    (("cuda",), {"non_blocking": True, "copy": True}, ("cuda", None, True, True)),
    ((torch.float64, True), {}, (None, torch.float64, True, False)),
    ((torch.float64,), {"copy": True}, (None, torch.float64, False, True)),
    ((y, True), {}, (y.device, torch.int16, True, False)),
    ((), {"other": y, "non_blocking": True}, (y.device, torch.int16, True, False)),
    ((), {"device": 0, "dtype": torch.int32}, (0, torch.int32, False, False)),
])
def test_to_in_every_form(rest, kwargs, expected):
    assert to_args(rest, kwargs) == expected


@pytest.mark.parametrize("rest, kwargs, expected", [
    ((), {}, ("cuda", False)), ((0, True), {}, (0, True)), ((), {"non_blocking": True}, ("cuda", True)),
    (("cuda:1",), {"non_blocking": True}, ("cuda:1", True)), ((None, True), {}, ("cuda", True)),
])
def test_cuda_in_every_form(rest, kwargs, expected):
    assert cuda_args(rest, kwargs) == expected


def test_copy_calls():
    dst = torch.zeros(3)
    assert copy_call("copy_", (dst, x, True), {}) == CopyCall("copy_", x, dst, None, None, True)
    assert copy_call("copy_", (dst, x), {"non_blocking": True}).non_blocking is True
    assert copy_call("copy_", (dst,), {"src": x}).src is x
    assert copy_call("copy_", (dst,), {}) is None, "copy_ without a source is not a copy"
    assert copy_call("__setitem__", (dst, 0, x), {}) == CopyCall("__setitem__", x, dst, None, None, False)
    assert copy_call("to", (x, "cuda", torch.float16, True), {}) == CopyCall(
        "to", x, None, "cuda", torch.float16, True, False)
    assert copy_call("cuda", (x, 0, True), {}).non_blocking is True
    assert copy_call("cpu", (x,), {}) == CopyCall("cpu", x, None, "cpu", None, False)
    assert copy_call("_to_copy", (x,), {"device": "cuda", "non_blocking": True}).non_blocking is True
    assert copy_call("add", (x, x), {}) is None and copy_call("to", ("not a tensor",), {}) is None


def test_device_type():
    assert [device_type(d) for d in ("cuda:1", torch.device("cuda", 1), 1, None, "cpu", True)] == [
        "cuda", "cuda", "cuda", None, "cpu", None]
    assert parse_to_args(("cuda:0", torch.float16, True), {}) == ("cuda", torch.float16, True)


def test_no_interception_site_parses_non_blocking_itself():
    """The five hand-written parsers read ``args[2]`` or ``rest[0]`` for non_blocking; only copyargs may."""
    hand = re.compile(r"non_blocking\W+\s*=.*(args\[2\]|rest\[0\])|bool\(args\[2\]\)")
    found = [f"{p.relative_to(LIB)}:{n}" for p in sorted(LIB.rglob("*.py")) if p.name != "copyargs.py"
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if hand.search(line)]
    assert not found, f"non_blocking parsed by hand outside pinlab.copyargs: {found}"
