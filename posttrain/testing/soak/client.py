"""The client: greedy token-id completions to production all along, every reply recorded (status,
the identity it is stamped with, tokens, logprobs), so that the checker can recompute each one with
the weights of the identity it names."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from posttrain.testing.soak.record import Background, Recorder, now

# Token-id prompts within the tiny model's vocabulary, the same all along
PROMPTS = ([1, 2, 3, 4], [5, 9, 14, 20, 27], [30, 31, 32], [7, 7, 7, 7, 7, 7])
MAX_TOKENS = 4
TEMPERATURE = 0.0


class Client(Background):
    def __init__(self, rec: Recorder, url: str, token: str, model: str, interval_s: float = 0.5) -> None:
        super().__init__("client")
        self.rec, self.url, self.token, self.model, self.interval_s = rec, url, token, model, interval_s
        self.sent = 0
        self.by_status: dict[int, int] = {}

    def _loop(self) -> None:
        i = 0
        while not self.stopping.wait(self.interval_s):
            self.ask(PROMPTS[i % len(PROMPTS)])
            i += 1

    def ask(self, prompt: list[int]) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE,
                "logprobs": 1}
        row = {"at": now(), "deployment": "production", "status": 0, "identity": None, "prompt_ids": prompt,
               "token_ids": None, "logprobs": None, "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE,
               "error": None}
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                row["status"] = r.status
                reply = json.loads(r.read())
            choice = reply["choices"][0]
            row.update(identity=reply.get("snapshot_identity"), token_ids=choice["token_ids"],
                       logprobs=choice["logprobs"]["token_logprobs"])
        except urllib.error.HTTPError as e:
            row.update(status=e.code, error=e.read()[:300].decode(errors="replace"))
        except (OSError, ValueError, KeyError) as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        self.sent += 1
        self.by_status[row["status"]] = self.by_status.get(row["status"], 0) + 1
        self.rec.write("replies", row)
        return row
