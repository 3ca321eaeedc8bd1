"""An OpenAI-compatible judge for tests, on 127.0.0.1: ``with JudgeServer("good") as judge:``.

``POST …/chat/completions`` (under /v1 or not: lmms-eval's llm_judge clients append the path to
the base URL, MMBench posts to the URL it is given). Modes:

- ``good``: every call answered, deterministically, the way the asking task expects: LLaVA-W's
  (and toy_chat's) comparison ``10 K``, K the token F1 of answer 2 against answer 1 × 10;
  MM-Vet's correctness 1.0 when the ground truth (before <AND>/<OR>) occurs in the prediction;
  MathVista's extraction, the response's last number (else its last word); MMBench's matching,
  the letter of the (longest) option whose text occurs in the answer, else Z; otherwise ``OK``.
- ``fail``: every call answered HTTP 500 with an OpenAI-style error body.
- ``flaky``: the 1st, 3rd, … calls fail as in ``fail``, the others as in ``good``.
- ``empty``: every call answered, with empty content.
- ``garbage``: every call answered with a sentence that holds no rating (``I cannot rate this.``).
- ``range``: every call answered ``7``, a number outside MM-Vet's 0–1 correctness.

``answered=N``: the first N calls are answered as in ``good`` whatever the mode (a judge that
passes preflight's one request, then goes down). ``mode`` may be changed while the server runs.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pipeline.eval.scoring import token_f1

MODES = ("good", "fail", "flaky", "empty", "garbage", "range")
UNUSABLE = {"empty": "", "garbage": "I cannot rate this.", "range": "7"}  # what the unusable modes answer
ERROR = {"error": {"message": "the test judge is down", "type": "server_error", "param": None, "code": "down"}}
# The two answers of a comparison: "[Assistant 1]\n…\n\n[End of Assistant 1]" (End lines optional).
COMPARED = re.compile(
    r"\[(?P<role>[^\]\n]+) 1\]\n(?P<first>.*?)\s*(?:\[End of (?P=role) 1\]\s*)?"
    r"\[(?P=role) 2\]\n(?P<second>.*?)\s*(?:\[End of (?P=role) 2\]|\n\[[^\]\n]+\]\n|\Z)",
    re.DOTALL,
)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def judgement(prompt: str) -> str:
    """What a sensible judge answers to one prompt of a judged task."""
    if "Ground truth | Prediction | Correctness" in prompt:  # MM-Vet: a table row to complete
        row = re.split(r"\| [01]\.\d\n", prompt)[-1].rstrip().removesuffix("|")
        _question, truth, prediction = (cell.strip() for cell in row.split(" | ", 2))
        wanted = re.split(r"<AND>|<OR>", truth)[0].strip().lower()
        return "1.0" if wanted in prediction.lower() else "0.0"
    if prompt.rstrip().endswith("Extracted answer:"):  # MathVista: the response is the last paragraph
        response = prompt.rstrip().removesuffix("Extracted answer:").rstrip().split("\n\n")[-1]
        found = NUMBER.findall(response) or re.findall(r"\w+", response)
        return found[-1] if found else ""
    if prompt.rstrip().endswith("Your output:"):  # MMBench: match the answer to an option
        options, answer = prompt.rsplit("Options:", 1)[1].rsplit("\nAnswer:", 1)
        answer = answer.rsplit("\nYour output:", 1)[0].lower()
        texts = {letter: text.strip().lower() for letter, text in re.findall(r"^([A-E])\. (.+)$", options, re.M)}
        matches = sorted((len(text), letter) for letter, text in texts.items() if text in answer)
        return matches[-1][1] if matches else "Z"
    if compared := COMPARED.search(prompt):
        return f"10 {round(10 * token_f1(compared['second'], compared['first']))}\nScored by token overlap."
    return "OK"


class JudgeServer:
    """The judge in one mode, on an ephemeral port of 127.0.0.1 while the context is open;
    ``calls`` counts the chat completions asked for, ``failed`` those answered with an error."""

    def __init__(self, mode: str, model: str = "test-judge", answered: int = 0):
        if mode not in MODES:
            raise ValueError(f"JudgeServer mode '{mode}' is not one of {MODES}")
        self.mode, self.model, self.answered = mode, model, answered
        self.calls = self.failed = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> JudgeServer:
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()  # quick shutdown
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reply(self, body: dict) -> tuple[int, dict]:
        """The status and JSON body that answer one chat completion request."""
        with self._lock:
            self.calls += 1
            number = self.calls
            fails = number > self.answered and (self.mode == "fail" or (self.mode == "flaky" and number % 2 == 1))
            self.failed += fails
        if fails:
            return 500, ERROR
        unusable = number > self.answered and self.mode in UNUSABLE
        content = UNUSABLE[self.mode] if unusable else judgement(_prompt(body.get("messages", [])))
        return 200, {
            "id": f"chatcmpl-test-{number}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }


def _prompt(messages: list[dict]) -> str:
    """The last user message's text (a string, or the text parts of a multimodal message)."""
    content = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if part.get("type") == "text")
    return content or ""


def _handler(judge: JudgeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if not self.path.rstrip("/").endswith("/chat/completions"):
                return self._send(404, {"error": {"message": f"no endpoint {self.path}", "type": "not_found"}})
            size = int(self.headers.get("Content-Length", 0))
            self._send(*judge.reply(json.loads(self.rfile.read(size) or b"{}")))

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # quiet: no line per request on stderr
            pass

    return Handler
