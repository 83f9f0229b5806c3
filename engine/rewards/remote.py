"""A remote HTTP scorer (``task.reward_url``): batches of samples POSTed as JSON, one score
per sample back, with timeouts and retries (requests + urllib3's ``Retry``).

The request (OpenRLHF's ``--remote_rm_url`` fields, so its ``serve_rm`` and servers written for
it answer as they are, plus the parts separately)::

    POST <task.reward_url>   Content-Type: application/json
    {"query":     ["<prompt+response as the policy saw it (chat template applied when used)>", ...],
     "prompts":   [<the prompt: text, or a list of {role, content} messages>, ...],
     "responses": ["<the response text>", ...],
     "labels":    ["<the reference answer>", ...],
     "rows":      [{<the sample's other dataset columns>}, ...]}

The reply: ``{"rewards": [float, ...]}`` (OpenRLHF's key), one finite number per sample in
order; other keys are ignored. A request that cannot connect, times out
(``task.reward_url_timeout_s``) or gets HTTP 429/500/502/503/504 is retried
``task.reward_url_retries`` times with exponential backoff (honouring ``Retry-After``); what
still fails, any other HTTP error, or a reply that is not that JSON fails the batch
(``ScorerFailed``), and ``task.reward_on_error`` decides: stop the run, or score it 0 and count it.
"""

from __future__ import annotations

import json
import socket
from typing import Callable, Optional
from urllib.parse import urlsplit

from engine.errors import ConfigError
from engine.rewards.call import Sample
from engine.rewards.scorers import ScorerFailed, finite_scores, plain_text

RETRY_STATUSES = (429, 500, 502, 503, 504)


def check_url(url: str, key: str = "task.reward_url") -> tuple[str, int]:
    """(host, port) of an http(s) URL, or ConfigError naming what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"`{key}={url}` is not an http(s) URL: give the scorer's address, e.g. "
                          f"{key}=http://127.0.0.1:5000/get_reward.", title="invalid config value")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ConfigError(f"`{key}={url}` has an invalid port.", title="invalid config value") from None
    return parts.hostname, port


def check_reachable(url: str, timeout_s: float, key: str = "task.reward_url") -> str:
    """Open (and close) a TCP connection to the scorer's host and port: a run never starts against
    a server that is not there. Raises ConfigError (exit 2) naming the address and the fix."""
    host, port = check_url(url, key)
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, 10.0)):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__ if not isinstance(e, socket.timeout) else "timed out"
        raise ConfigError(f"`{key}={url}`: nothing answers at {host}:{port} ({why}). Start the scorer first (and "
                          f"check it listens on that address and port), or fix the URL; unset {key} to train "
                          f"without it.", title="remote scorer unreachable") from None
    return f"{host}:{port} accepts connections"


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


class RemoteScorer:
    """``task.reward_url``: one POST per ``batch_size`` samples, on the driver."""

    name = "reward_url"

    def __init__(self, url: str, *, weight: float = 1.0, timeout_s: float = 60.0, retries: int = 3,
                 batch_size: int = 64, render: Optional[Callable[[object, str], str]] = None,
                 backoff_s: float = 0.5):
        check_url(url)
        self.url, self.weight, self.timeout_s, self.retries = url, float(weight), float(timeout_s), int(retries)
        self.batch_size, self.backoff_s = int(batch_size), float(backoff_s)
        self.render = render or plain_text
        self._session = None

    def describe(self) -> str:
        return (f"{self.weight:g} x {self.name} {self.url} (batches of {self.batch_size}, timeout "
                f"{self.timeout_s:g} s, {self.retries} retries)")

    def session(self):
        if self._session is None:
            import requests
            from requests.adapters import HTTPAdapter
            from urllib3.util.retry import Retry

            retry = Retry(total=self.retries, connect=self.retries, read=self.retries, status=self.retries,
                          other=0, allowed_methods=None, status_forcelist=RETRY_STATUSES,
                          backoff_factor=self.backoff_s, backoff_max=30.0, raise_on_status=False,
                          respect_retry_after_header=True)
            s = requests.Session()
            s.trust_env = False  # a scorer's address is what the config says: no proxy from the environment
            adapter = HTTPAdapter(max_retries=retry)
            s.mount("http://", adapter)
            s.mount("https://", adapter)
            self._session = s
        return self._session

    def payload(self, samples: list[Sample]) -> bytes:
        body = {"query": [self.render(s.prompt, s.response) for s in samples],
                "prompts": [s.prompt for s in samples],
                "responses": [s.response for s in samples],
                "labels": [s.answer for s in samples],
                "rows": [{k: v for k, v in s.row.items() if k not in ("prompt", "answer")} for s in samples]}
        return json.dumps(body, default=_jsonable).encode()

    def score(self, samples: list[Sample]) -> list[float]:
        """Every batch is sent, even after one failed; then the first failure is raised with every
        failed row and the scores of the batches that succeeded."""
        out: dict[int, float] = {}
        failed: list[ScorerFailed] = []
        for a in range(0, len(samples), self.batch_size):
            try:
                out.update(enumerate(self._post(samples[a:a + self.batch_size], a), start=a))
            except ScorerFailed as e:
                failed.append(e)
        if failed:
            raise ScorerFailed(str(failed[0]) + (f" (and {len(failed) - 1} more batch(es))" if len(failed) > 1 else ""),
                               [i for e in failed for i in e.rows], out)
        return [out[i] for i in range(len(samples))]

    def _post(self, chunk: list[Sample], first: int) -> list[float]:
        import requests

        rows = range(first, first + len(chunk))
        tries = f"{self.retries} retr{'y' if self.retries == 1 else 'ies'}"
        try:
            r = self.session().post(self.url, data=self.payload(chunk), timeout=self.timeout_s,
                                    headers={"Content-Type": "application/json"})
        except (requests.Timeout, requests.ConnectionError) as e:
            # urllib3 retries both; a read timeout it gave up on arrives as a ConnectionError
            if isinstance(e, requests.Timeout) or "timed out" in str(e).lower():
                raise ScorerFailed(f"no reply from {self.url} within task.reward_url_timeout_s="
                                   f"{self.timeout_s:g} s (after {tries})", rows) from None
            raise ScorerFailed(f"cannot connect to {self.url} after {tries} ({_reason(e)})", rows) from None
        except requests.RequestException as e:
            raise ScorerFailed(f"request to {self.url} failed: {type(e).__name__}: {_reason(e)}", rows) from None
        if r.status_code != 200:
            retried = f" after {tries}" if r.status_code in RETRY_STATUSES else ""
            raise ScorerFailed(f"{self.url} answered HTTP {r.status_code}{retried}: {r.text[:200]!r}", rows)
        try:
            reply = r.json()
        except ValueError:
            raise ScorerFailed(f"{self.url} answered with something that is not JSON: {r.text[:200]!r}; the reply "
                               f"must be {{\"rewards\": [one number per sample]}}", rows) from None
        values = reply.get("rewards") if isinstance(reply, dict) else reply
        if isinstance(reply, dict) and "rewards" not in reply:
            raise ScorerFailed(f"{self.url} answered JSON without a \"rewards\" key (keys: "
                               f"{', '.join(map(str, list(reply)[:8])) or 'none'}); the reply must be "
                               f"{{\"rewards\": [one number per sample]}}", rows)
        try:
            return finite_scores(values, len(chunk), self.url)
        except ValueError as e:
            raise ScorerFailed(str(e), rows) from None

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


def _reason(exc: BaseException) -> str:
    """The innermost reason of a requests/urllib3 error, short."""
    inner = exc
    for _ in range(4):
        nxt = getattr(inner, "reason", None) or (inner.args[0] if inner.args and isinstance(inner.args[0],
                                                                                             BaseException) else None)
        if not isinstance(nxt, BaseException):
            break
        inner = nxt
    text = str(inner)
    if "Connection refused" in text:
        return "connection refused"
    return text[:200]
