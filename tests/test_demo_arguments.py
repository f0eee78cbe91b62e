"""The demo's fleet command lines survive any token (a random token may start with '-')."""

from __future__ import annotations

import pytest

from rollout_checkpoint.examples.demo import serve_options
from rollout_checkpoint.examples.serve import parse_args


@pytest.mark.parametrize("token", ["-leading-dash", "--double", "plain"])
@pytest.mark.parametrize("start_closed", [False, True])
def test_every_token_reaches_the_server_unchanged(token: str, start_closed: bool) -> None:
    args = parse_args(["counter", *serve_options(token, start_closed=start_closed)])
    assert args.token == token and args.start_closed is start_closed
