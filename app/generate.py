"""`tandem generate`: stream one chat reply to stdout."""

from __future__ import annotations

import json
import sys

from engine.core.request import SamplingParams

from .engine_setup import engine_from_args


def run_generate(args) -> int:
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    sampling.validate()
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    with engine_from_args(args, calibrate=False) as eng:  # one request: nothing to route
        if eng.model is not None and eng.model.synthetic:
            print("(synthetic model: random weights, the text is noise)", file=sys.stderr)
        handle = eng.chat(messages, sampling, source="cli")
        try:
            for delta in handle:
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            handle.cancel()
            raise
        record = handle.result()
        sys.stdout.write("\n")
        if args.stats:
            print(json.dumps(record.to_dict()), file=sys.stderr)
        if record.error:
            print(f"tandem: {record.error}", file=sys.stderr)
            return 1
    return 0
