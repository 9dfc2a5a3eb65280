"""Validates structured outputs with an independent JSON-schema validator.

usage: validate_json_schema.py CASES.json
CASES.json: [{"schema": {...}, "output": "<text>", "label": "..."}]. Exits 0
when every output parses and validates; otherwise prints each failure.
Exit 3 when the `jsonschema` package is missing (the test then skips).
"""
import json
import sys

try:
    import jsonschema
except ImportError:
    print("the jsonschema package is not installed", file=sys.stderr)
    sys.exit(3)


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    failures = 0
    for case in cases:
        try:
            value = json.loads(case["output"])
            jsonschema.Draft202012Validator(case["schema"]).validate(value)
        except Exception as e:  # parse error or validation error: both are failures
            failures += 1
            print(f"FAIL {case['label']}: {e!s:.300}\n  output: {case['output']!r}")
    print(f"{len(cases) - failures}/{len(cases)} outputs valid")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
