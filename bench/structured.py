"""Structured output on a real package: 10 JSON schemas x 10 sampled
outputs each must all parse and validate, and what the grammar costs a
decode step at batch 8, in one run.

    python bench/structured.py --package PKG [--max-new-tokens 160]

Prints JSON: per schema how many of its outputs validated, the total, and
the decode tokens/s of 8 sessions with and without a grammar (the mask is
computed per session before each draw: its share of a step is the
overhead), with the CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema
import torch

from common import cpu_model, emit
from kvexport.contract.sampler import SamplingConfig
from kvexport.runtime import generate, load
from kvexport.runtime.grammar import Grammar

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
               "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
               "additionalProperties": False},
    "colour": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue", "yellow"]}},
               "required": ["colour"], "additionalProperties": False},
    "planet": {"type": "object", "properties": {"planet": {"type": "string", "maxLength": 20},
               "moons": {"type": "integer", "minimum": 0, "maximum": 200}, "rocky": {"type": "boolean"}},
               "required": ["planet", "moons", "rocky"], "additionalProperties": False},
    "list": {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 15},
             "minItems": 1, "maxItems": 4}}, "required": ["items"], "additionalProperties": False},
    "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
              "y": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x", "y"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
               "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "role": {"enum": ["admin", "guest"]}},
               "required": ["id", "role"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 5},
    "event": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 25},
              "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
              "hours": {"type": "number", "minimum": 0.5, "maximum": 8}}, "required": ["title", "day", "hours"],
              "additionalProperties": False},
    "answer": {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
               "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"],
               "additionalProperties": False},
    "order": {"type": "object", "properties": {"product": {"type": "string", "maxLength": 20},
              "quantity": {"type": "integer", "minimum": 1, "maximum": 50},
              "express": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["gift", "fragile", "bulk"]},
              "maxItems": 3}}, "required": ["product", "quantity", "express"], "additionalProperties": False},
}

PROMPTS = {
    "person": "Describe a person as JSON.", "colour": "Pick a colour, as JSON.", "planet": "Describe a planet as JSON.",
    "list": "List a few fruits as JSON.", "point": "Give a point on a plane as JSON.", "nested": "Describe a user as JSON.",
    "scores": "Give some test scores as a JSON array.", "event": "Describe a meeting as JSON.",
    "answer": "What is the capital of Italy? Answer as JSON.", "order": "Write a shop order as JSON.",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--package", required=True, type=Path)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--outputs", type=int, default=10, help="sampled outputs per schema")
    args = parser.parse_args()

    runtime = load(args.package)
    text = runtime.package.tokenizer()
    sampling = SamplingConfig(temperature=0.7, top_p=0.95)
    result: dict = {"package": str(args.package), "cpu": cpu_model(), "torch_threads": torch.get_num_threads(),
                    "schemas": {}}
    valid = total = 0
    for name, schema in SCHEMAS.items():
        grammar = Grammar.json_schema(text, schema, runtime.vocab_size, runtime.eos_ids)
        prompt = text.encode(PROMPTS[name])
        outputs = generate(runtime, [prompt] * args.outputs, args.max_new_tokens, sampling, seed=11, grammar=grammar)
        ok = 0
        for out in outputs:
            try:
                jsonschema.validate(json.loads(text.decode(out)), schema)
                ok += 1
            except (json.JSONDecodeError, jsonschema.ValidationError):
                pass
        result["schemas"][name] = f"{ok}/{len(outputs)}"
        valid, total = valid + ok, total + len(outputs)
    result["valid"] = f"{valid}/{total}"

    # the grammar's cost at batch 8: a decode step of 8 sessions, against the time one step's masks
    # (apply_masks, all sessions' together) and advances take (measured around those calls in a
    # constrained run)
    import sys

    generate_module = sys.modules["kvexport.runtime.generate"]  # the module (the package exports the function)
    from kvexport.runtime import grammar as grammar_module

    prompts = [text.encode(PROMPTS["list"])] * 8
    generate(runtime, prompts, 4)  # warm-up
    start = time.perf_counter()
    generate(runtime, prompts, 1, stop_at_eos=False)
    middle = time.perf_counter()
    generate(runtime, prompts, 33, stop_at_eos=False)
    step_s = ((time.perf_counter() - middle) - (middle - start)) / 32
    spent = {"seconds": 0.0, "steps": 0, "rows": 0}

    def timed(original, masks: bool):
        def call(*a):
            began = time.perf_counter()
            try:
                return original(*a)
            finally:
                spent["seconds"] += time.perf_counter() - began
                if masks:
                    spent["steps"] += 1
                    spent["rows"] += len(a[0])
        return call

    generate_module.apply_masks = timed(generate_module.apply_masks, True)
    grammar_module.Constraint.advance = timed(grammar_module.Constraint.advance, False)
    grammar = Grammar.json_schema(text, SCHEMAS["order"], runtime.vocab_size, runtime.eos_ids)
    generate(runtime, prompts, 48, SamplingConfig(0.7), seed=3, grammar=grammar)
    per_step = spent["seconds"] / (spent["rows"] / 8)  # a step of fewer than 8 sessions counts as part of one
    result["batch8"] = {"decode_step_ms": round(1e3 * step_s, 2), "grammar_ms_per_step": round(1e3 * per_step, 2),
                        "overhead": round(per_step / step_s, 3), "masked_steps": spent["steps"]}
    emit(result)


if __name__ == "__main__":
    main()
