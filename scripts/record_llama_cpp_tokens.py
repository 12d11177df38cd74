"""Record llama.cpp's tokenization of fixed strings as tests/fixtures/smollm2_llama_cpp_tokens.json.

Run once after scripts/build_llama_cpp.sh; tests/test_smollm2.py checks gmlx's GGUF tokenizer
against the file. The command line used is stored in the file beside the token ids.

    python3 scripts/record_llama_cpp_tokens.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gmlx.models.source import resolve_model_path  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "smollm2_llama_cpp_tokens.json"
# Plain prose, code, digits, whitespace runs, unicode, emoji and the chat special tokens.
TEXTS = [
    "The capital of France is",
    "Hello world",
    " leading space and  double  spaces",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Numbers: 1234567890, 3.14159, -42, 1e-10",
    "a  1   22 x    333",
    "Tabs\tand\nnewlines\n\n\nand trailing spaces   ",
    "naïve café résumé Zürich Ελληνικά русский 日本語 한국어",
    "Emoji: 🙂🚀👍🏽 and symbols © ™ € ≤ ≥",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure you'll see they've done it, we'd've known.",
    "URL: https://example.com/path?query=1&b=2#frag",
    "<|endoftext|>",
    "MixedCASE camelCase snake_case SCREAMING_CASE",
    "    indented code block",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--llama-cpp-bin", default=str(ROOT / ".cache/llama.cpp/bin"))
    args = parser.parse_args()
    model = resolve_model_path(args.model)
    binary = Path(args.llama_cpp_bin) / "llama-tokenize"
    command = [str(binary), "-m", str(model), "--stdin", "--no-escape", "--ids", "--log-disable"]
    cases = []
    for text in TEXTS:
        result = subprocess.run(command, input=text.encode("utf-8"), capture_output=True, timeout=300)
        if result.returncode != 0:
            sys.exit(f"llama-tokenize failed on {text!r}: {result.stderr.decode(errors='replace')[-2000:]}")
        lines = [line for line in result.stdout.decode().splitlines() if line.startswith("[")]
        cases.append({"text": text, "token_ids": json.loads(lines[-1])})
    shown = ["llama-tokenize", "-m", "<SmolLM2-135M-Instruct.Q4_1.gguf>"] + command[3:]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    header = {"command": " ".join(shown) + "  (text on stdin)",
              "recorded_by": "python3 scripts/record_llama_cpp_tokens.py",
              "llama_cpp_source": "llama-cpp-python sdist, vendor/llama.cpp (scripts/build_llama_cpp.sh)"}
    lines = [json.dumps(case, ensure_ascii=False) for case in cases]  # one case a line: readable diffs
    body = json.dumps(header, indent=1, ensure_ascii=False)[:-2]
    OUT.write_text(body + ',\n "cases": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
