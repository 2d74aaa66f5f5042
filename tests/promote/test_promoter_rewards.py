"""The gate and its reward functions, through real reference servers (staging and production) and a
store folder: a reward that is not a number (a reward service's outage) during the champion's turn is
an eval failure that refuses the candidate, naming the side and the function, and is never stored; the
stored evals are keyed by the reward functions' code, so changed code evaluates the champion again."""

from __future__ import annotations

import importlib
import sys
import uuid
from pathlib import Path

import pytest

from posttrain.promote.decision import GateConfig
from posttrain.promote.evaluate import EvalSettings, EvalStore, eval_digest
from posttrain.promote.history import History
from posttrain.promote.promoter import promote
from tests.support.promotion import eval_rows, greedy_eval, served_identities, staging_and_production

# reference_match (posttrain.testing.rewards), and a switch that makes its next calls answer NaN,
# as a reward service that is down would
REWARD_SOURCE = '''
import math

NAN_CALLS = [0]


def reward(completion_ids, reference_ids, **kwargs):
    if NAN_CALLS[0] > 0:
        NAN_CALLS[0] -= 1
        return [math.nan] * len(completion_ids)
    scores = []
    for ids, ref in zip(completion_ids, reference_ids, strict=True):
        ref = list(ref)
        scores.append(sum(a == b for a, b in zip(ids, ref, strict=False)) / len(ref) if ref else 0.0)
    return scores
'''


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A reward module written in tmp_path (a fresh name per test, on sys.path): its name and file."""
    name = f"gate_reward_{uuid.uuid4().hex[:8]}"
    path = tmp_path / "rewards" / f"{name}.py"
    path.parent.mkdir()
    path.write_text(REWARD_SOURCE)
    monkeypatch.syspath_prepend(str(path.parent))
    yield name, path
    sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def rows(chain):
    return eval_rows(chain.models)


@pytest.fixture(scope="module")
def tokenizer(chain):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chain.models[0])


@pytest.fixture
def site(chain, store_copy, tmp_path):
    """Staging and production reference servers on one store; yields (store, staging, production, prod api)."""
    with staging_and_production(chain, store_copy, tmp_path) as (store, staging, production, apis):
        yield store, staging, production, apis[1]


def gate_run(site, rows, tokenizer, candidate, reward: str, run: str):
    store, staging, production, _ = site
    settings = EvalSettings(**greedy_eval(reward_funcs=[reward]))
    return promote(store=store, candidate=candidate, run=run, settings=settings, rows=rows,
                   gate=GateConfig(samples_per_prompt=settings.samples_per_prompt, first_promotion="own_eval"),
                   dataset_digest="d" * 64,
                   tokenizer=tokenizer, staging=staging, production=production)


def test_nan_rewards_during_the_champions_eval_refuse_the_candidate_and_are_never_stored(
        chain, site, rows, tokenizer, reward_module):
    store, _, _, prod_api = site
    name, _ = reward_module
    reward = f"{name}:reward"
    gate_run(site, rows, tokenizer, chain.d1, "posttrain.testing.rewards:reference_match", "nightly-1")  # champion

    importlib.import_module(name).NAN_CALLS[0] = 1  # down for the champion's first prompt (a call per prompt)
    refused = gate_run(site, rows, tokenizer, chain.d2, reward, "nightly-2")
    assert not refused.promoted and set(refused.failures) == {"champion"} and refused.champion_eval is None
    reason = refused.record.reason
    assert reason.startswith(f"refused: the champion {chain.d1} could not be evaluated"), reason
    assert f"champion: EvalError: prompt q00: reward function {reward} returned nan" in reason
    assert "\n" not in reason and served_identities(prod_api, "prod") == {chain.d1}
    digest = eval_digest("d" * 64, EvalSettings(**greedy_eval(reward_funcs=[reward])), len(rows))
    assert EvalStore(store).get(digest, chain.d1) is None  # nothing of the failed eval is kept

    again = gate_run(site, rows, tokenizer, chain.d2, reward, "nightly-3")  # the next night, the service is back
    assert again.promoted and again.champion_eval is not None and again.champion_eval.mean > 0
    assert served_identities(prod_api, "prod") == {chain.d2}
    assert [r.kind for r in History(store, "", "prod").records()] == ["promotion", "refusal", "promotion"]


def test_changed_reward_code_evaluates_the_champion_again(chain, site, rows, tokenizer, reward_module):
    name, path = reward_module
    reward = f"{name}:reward"
    first = gate_run(site, rows, tokenizer, chain.d1, reward, "nightly-1")
    better = gate_run(site, rows, tokenizer, chain.d2, reward, "nightly-2")
    assert better.promoted and better.champion_eval == first.candidate_eval  # same code: the stored eval, reused

    # the reward's code changes (here: it counts only the first token), and a new process loads it
    path.write_text(REWARD_SOURCE.replace("ref = list(ref)", "ref = list(ref)[:1]"))
    sys.modules.pop(name)
    worse = gate_run(site, rows, tokenizer, chain.full, reward, "nightly-3")
    assert worse.champion_eval is not None and worse.champion_eval.digest != better.candidate_eval.digest
    assert worse.champion_eval.at > better.candidate_eval.at  # evaluated again, under the new code
    assert worse.candidate_eval.digest == worse.champion_eval.digest  # both sides judged by the same code
