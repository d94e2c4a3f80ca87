"""``min_tokens`` with stop tokens through the engine (vllm-ascend 0.18.0 on CPU, the NPU emulation; vLLM 0.13 builds
no min-tokens processor with a speculative config): requests at temperature 2.0 (the engine's seed) whose stop tokens
are half the vocabulary, so a stop token is drawn about every other time ``MinTokensLogitsProcessor`` does not mask
them, and most drafts are rejected. Zero-bubble (``ZB_PATCH=1``) must give classic async's tokens
(``ZB_PATCH_DISABLE=<zero-bubble>``: the same schedules and random draws), and neither may emit a stop token before
``min_tokens`` (the scheduler does not stop a request there, vLLM #26317, so such a token sits inside the output).
zb-patch's zero-bubble before ``ZeroBubble.trim_placeholders`` emitted 12 (its ``-1`` per rejected draft counted as
output; the runner-parity form is tests/patches/test_sampling_fields.py).
"""

from __future__ import annotations

from importlib.metadata import version

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va013-e2e / va018-e2e envs)")

from zb_patch.check.engine import model as tiny_model  # noqa: E402
from zb_patch.check.engine.run import run_all  # noqa: E402
from zb_patch.check.engine.workload import Workload, divergences  # noqa: E402

if version("vllm-ascend") != "0.18.0":
    pytest.skip("min_tokens with spec decode: vllm-ascend 0.18.0 (vLLM 0.13 ignores it)", allow_module_level=True)
from test_sampling_engine import _engine  # noqa: E402 (the sampling launcher's engine process)

WORKLOAD = Workload(
    num_requests=6, max_prompt=30, max_tokens=40, num_speculative_tokens=3, limit_every=4, max_num_batched_tokens=256
)
MIN_TOKENS = 24
STOPS = list(range(0, tiny_model.VOCAB, 2))
SAMPLING = dict(temperature=2.0, min_tokens=MIN_TOKENS, stop_token_ids=STOPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    models = str(tmp_path_factory.mktemp("min-tokens-models"))
    tiny_model.write_models(models)
    out = str(tmp_path_factory.mktemp("min-tokens"))
    on = {"ZB_PATCH": "1"}
    jobs = [
        _engine(models, out, name, async_scheduling=True, env=env, sampling=SAMPLING, workload=WORKLOAD)
        for name, env in (
            ("async+fixes", {**on, "ZB_PATCH_DISABLE": "zb018-optimistic-update-states"}),
            ("async+zb", on),
        )
    ]
    done = run_all(jobs, parallel=2)
    for r in done:
        assert r.result is not None, (r.name, r.returncode, r.stderr[-3000:])
    return {r.name: r.result for r in done}


def _early_stops(result: dict) -> list[tuple[str, int, int]]:
    """(request, position, token) of every stop token before ``min_tokens`` (capped at the request's length)."""
    stops = set(STOPS)
    out = []
    for req, toks in result["tokens"].items():
        for i, t in enumerate(toks[:MIN_TOKENS]):
            if t in stops:
                out.append((req, i, t))
    return out


def test_zero_bubble_masks_stop_tokens_until_min_tokens(runs, capsys):
    """No stop token before ``min_tokens`` (capped at the request's length) in either run, the same tokens, drafts and
    acceptances, and rejected drafts to reach the mask's edge with."""
    fixes, zb = runs["async+fixes"], runs["async+zb"]
    with capsys.disabled():
        print(
            f"\nmin_tokens {MIN_TOKENS}, {len(STOPS)} stop tokens: drafted {sum(zb['drafted'].values())}, "
            f"accepted {sum(zb['accepted'].values())}; stop tokens before min_tokens: async+fixes "
            f"{len(_early_stops(fixes))}, zero-bubble {len(_early_stops(zb))}"
        )
    assert _early_stops(fixes) == [] == _early_stops(zb), _early_stops(zb)[:8]
    assert divergences(fixes, zb) == []
    assert sum(zb["drafted"].values()) > sum(zb["accepted"].values()) > 0
