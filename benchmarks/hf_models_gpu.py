"""tests/test_hf_models.py's models on the GPU machine: graph breaks, compiled regions and parity.

    python -m bridge run benchmarks/hf_models_gpu.py [--train switch,switch-routing-corners] [--generate switch]

CI has no GPU, so this runs the test file's own cases there: each `--train` model trains 3 AdamW
steps on plain CPU torch and under the bridge on the GPU (the test's `_train`), then prints the
breaks, the regions compiled and the worst differences by the test's own rules (`_compare`, or
why they failed); each `--generate` model generates 10 tokens greedily with its default cache and
prints whether the tokens are torch's, the breaks, the programs compiled and the static caches
used. Run from the repository's root.
"""

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import test_hf_models as cases  # noqa: E402
from bridge.runtime import capture, stats  # noqa: E402


def train(name):
    case = cases.CASES[name]
    torch.manual_seed(0)
    model = case.build().train()
    reference_model = copy.deepcopy(model)
    inputs = case.inputs(torch.Generator().manual_seed(1))
    truth = cases._first_gradients_in_float64(model, inputs)
    reference = cases._train(reference_model, inputs, "cpu")
    capture.reset()
    result = cases._train(model.to("cuda"), inputs, "cuda")
    regions = sorted({record.region for record in capture.compiles})
    print(f"{name} training: {len(capture.breaks)} breaks, regions compiled {regions}")
    try:
        print(f"{name} parity: {cases._compare(case, reference, result, truth)}")
    except AssertionError as error:
        print(f"{name} parity FAILED: {str(error)[:400]}")


def generate(name):
    torch.manual_seed(0)
    reference = cases.CASES[name].build().eval()
    model = copy.deepcopy(reference).to("cuda")
    prompt = cases._prompt(name, torch.Generator().manual_seed(3))
    expected = cases._generate(reference, prompt, "cpu")
    capture.reset()
    stats.reset()
    result = cases._generate(model, prompt, "cuda")
    same = result.sequences.cpu().tolist() == expected.sequences.tolist()
    print(
        f"{name} generate: torch's tokens {same}, {len(capture.breaks)} breaks, {len(capture.compiles)} programs, "
        f"static caches {stats.summary()['hf_static_caches']}"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", default="switch,switch-routing-corners")
    parser.add_argument("--generate", default="switch")
    options = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {cases.transformers.__version__}")
    for name in filter(None, options.train.split(",")):
        train(name)
    for name in filter(None, options.generate.split(",")):
        generate(name)


if __name__ == "__main__":
    main()
