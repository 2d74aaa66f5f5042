"""``POST /v1/completions`` of the reference server: token ids and log-probs, n choices, refusals."""

from __future__ import annotations

import pytest
import requests
import torch

from tests.support.serving import PROMPT, TOKEN, Api, start_server


@pytest.fixture(scope="module")
def server(chain, tmp_path_factory):
    """One server for the module: nothing here changes its weights."""
    s = start_server(chain, tmp_path_factory.mktemp("work"))
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def api(server):
    return Api(server.url)


def _direct_logprobs(model_dir, prompt, completion, temperature, top_p=1.0):
    """Log-probs of ``completion`` after ``prompt`` from one plain forward pass (no cache, no padding)."""
    from transformers import AutoModelForCausalLM

    from posttrain.serve.sampler import top_p_filter

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = top_p_filter(logits / temperature, top_p)
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_n_choices_for_several_prompts_with_token_ids_and_logprobs(api):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    body = api.complete(prompt=prompts, n=3, max_tokens=6, temperature=1.0, top_p=1.0, logprobs=1,
                        return_tokens_as_token_ids=True, echo=False)
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert len(body["choices"]) == 6
    completion_tokens = 0
    for i, c in enumerate(body["choices"]):
        assert c["index"] == i and c["prompt_index"] == i // 3
        ids = c["token_ids"]
        assert 1 <= len(ids) <= 6
        assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
        assert len(c["logprobs"]["token_logprobs"]) == len(ids)
        assert all(lp <= 0 for lp in c["logprobs"]["token_logprobs"])
        assert c["finish_reason"] == ("length" if len(ids) == 6 and c["finish_reason"] != "stop" else "stop")
        assert isinstance(c["text"], str)
        completion_tokens += len(ids)
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": completion_tokens,
                             "total_tokens": 9 + completion_tokens}
    assert body["snapshot_identity"] is None  # boot weights that record no snapshot


def test_greedy_is_deterministic_and_matches_the_model(api, chain):
    first = api.greedy()
    assert first == api.greedy() == chain.greedy[0]
    body = api.complete(prompt=PROMPT, n=3, max_tokens=8, temperature=0)
    assert [c["token_ids"] for c in body["choices"]] == [first] * 3


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 1.0), (1.3, 0.6)])
def test_logprobs_are_those_of_the_sampling_distribution(api, chain, temperature, top_p):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]  # different lengths: left padding in the batch
    body = api.complete(prompt=prompts, n=2, max_tokens=6, temperature=temperature, top_p=top_p, seed=1)
    for c in body["choices"]:
        expected = _direct_logprobs(chain.models[0], prompts[c["prompt_index"]], c["token_ids"], temperature, top_p)
        assert c["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=2e-4)


def test_seed_reproduces_samples(api):
    a = api.complete(prompt=PROMPT, n=4, max_tokens=8, temperature=1.0, seed=7)
    b = api.complete(prompt=PROMPT, n=4, max_tokens=8, temperature=1.0, seed=7)
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert len({tuple(c["token_ids"]) for c in a["choices"]}) > 1  # the n choices are not copies


@pytest.mark.parametrize("field,value", [
    ("top_k", 5), ("presence_penalty", 0.5), ("frequency_penalty", 0.1), ("stop", ["x"]),
    ("logit_bias", {"5": 1}), ("best_of", 2), ("repetition_penalty", 1.1), ("min_p", 0.1), ("nonsense", 1),
])
def test_other_sampling_controls_are_refused_by_name(api, field, value):
    r = api.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hello", "max_tokens": 2}, "prompt"),
    ({"prompt": [5, -1], "max_tokens": 2}, "prompt"),
    ({"prompt": [5, 10**9], "max_tokens": 2}, "prompt"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 100000}, "max_tokens"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "echo": True}, "echo"),
    ({"prompt": PROMPT, "logprobs": 5}, "logprobs"),
])
def test_bad_requests_name_the_field(api, body, param):
    r = api.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_model_must_be_the_served_one(api):
    r = api.post("/v1/completions", json={"model": "other", "prompt": PROMPT})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = api.post("/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/health"),
    ("GET", "/v1alpha1/inference/hotLoads"), ("POST", "/v1alpha1/inference/hotLoads"),
    ("GET", "/v1alpha1/inference/hotLoads/x/replicas"),
])
@pytest.mark.parametrize("header", [None, "Bearer wrong", TOKEN, f"Basic {TOKEN}"])
def test_every_call_needs_the_bearer_token(server, method, path, header):
    headers = {"Authorization": header} if header else {}
    r = requests.request(method, server.url + path, headers=headers, timeout=10,
                         json={"model": "tiny", "prompt": PROMPT} if method == "POST" else None)
    assert r.status_code == 401
    assert TOKEN not in r.text


def test_models_and_health(api):
    models = api.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    health = api.get("/health").json()
    assert health["status"] == "ok" and health["deploymentId"] == "dep-test"
