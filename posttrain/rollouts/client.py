"""Client of an inference deployment's ``/v1/completions`` with token ids in and out.

Token ids are taken from the reply (``token_ids``, or ``logprobs.tokens`` written
``token_id:<int>``); text is never re-tokenized, which would be unsafe for RL. The reply's
``snapshot_identity`` (the weights that sampled it, stamped by posttrain's servers and gateways)
comes back with the choices, so a caller can check which version it sampled from.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import requests
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from posttrain.errors import TransientError


class CompletionsError(Exception):
    """A completions call failed for good (a bad request, a bad reply); the message never holds the token."""


class CompletionsUnavailable(CompletionsError, TransientError):
    """The deployment did not answer, or kept answering 429/5xx: worth trying again later."""


class CompletionsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gateway_url: str = Field(description="Data-plane URL of the deployment (its /v1/completions).")
    model: str = Field(description="Model name the deployment serves.")
    token: SecretStr | None = Field(None, description="Bearer token, if the gateway needs one.")
    timeout_s: float = Field(120.0, gt=0, description="Seconds per request.")
    max_attempts: int = Field(5, ge=1, description="Attempts per request on connection errors, 429 and 5xx.")
    backoff_s: float = Field(0.5, ge=0, description="First retry delay; doubles each attempt, with jitter.")


@dataclass(frozen=True)
class Choice:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


@dataclass(frozen=True)
class Completion:
    """The choices of one reply (in index order) and the snapshot identity that sampled them
    (None when the deployment does not say). Iterates, indexes and unpacks as its choices."""

    choices: list[Choice]
    snapshot_identity: str | None

    def __iter__(self) -> Iterator[Choice]:
        return iter(self.choices)

    def __len__(self) -> int:
        return len(self.choices)

    def __getitem__(self, i: int) -> Choice:
        return self.choices[i]


class CompletionsClient:
    def __init__(self, config: CompletionsConfig):
        self.config = config
        self.session = requests.Session()
        if config.token is not None:
            self.session.headers["Authorization"] = f"Bearer {config.token.get_secret_value()}"

    def close(self) -> None:
        self.session.close()

    def complete(self, prompt_ids: list[int], *, n: int, max_tokens: int, temperature: float,
                 top_p: float, seed: int | None = None) -> Completion:
        body = {"model": self.config.model, "prompt": prompt_ids, "n": n, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p, "logprobs": 1, "return_tokens_as_token_ids": True,
                "echo": False}
        if seed is not None:  # the same seed, prompt and weights sample the same completions
            body["seed"] = seed
        reply = self._post("/v1/completions", body)
        choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise CompletionsError(f"{self.config.gateway_url}: asked for {n} choices, got {len(choices)}")
        identity = reply.get("snapshot_identity")
        return Completion([_choice(c) for c in choices], str(identity) if identity else None)

    def _post(self, path: str, body: dict) -> dict:
        url = self.config.gateway_url.rstrip("/") + path
        last = ""
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                resp = self.session.post(url, json=body, timeout=self.config.timeout_s)
            except requests.RequestException as e:
                last = f"{type(e).__name__}"
            else:
                if resp.status_code == 200:
                    return resp.json()
                if resp.status_code != 429 and resp.status_code < 500:
                    raise CompletionsError(f"POST {url}: HTTP {resp.status_code}: {self._scrub(resp.text[:300])}")
                last = f"HTTP {resp.status_code}"
            if attempt < self.config.max_attempts:
                time.sleep(self.config.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
        raise CompletionsUnavailable(f"POST {url}: failed after {self.config.max_attempts} attempts ({last})")

    def _scrub(self, text: str) -> str:
        token = self.config.token.get_secret_value() if self.config.token is not None else ""
        return text.replace(token, "***") if token else text


def _choice(c: dict) -> Choice:
    lp = c.get("logprobs") or {}
    ids = c.get("token_ids")
    if ids is None:
        tokens = lp.get("tokens") or []
        try:
            ids = [int(t.split(":", 1)[1]) for t in tokens]
        except (IndexError, ValueError):
            raise CompletionsError("reply has no token ids (token_ids, or logprobs.tokens as token_id:<int>)") from None
    logprobs = [float(x) for x in lp.get("token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise CompletionsError(f"reply has {len(ids)} token ids but {len(logprobs)} logprobs")
    return Choice(list(map(int, ids)), logprobs, c.get("finish_reason"))
