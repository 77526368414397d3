"""A HuggingFace Trainer run as its users write one: GPT-2 (6 x 768) from a config, random
token batches of 8 x 512, TrainingArguments' defaults (AdamW fused on CUDA, linear schedule)
plus bf16. Prints one line `RESULT {json}`: the median step time over steps 20 to `--steps`, and
the seconds from the start of train() to the end of the first step.

Run as it is for torch, or under `python -m bridge run` for the bridge."""

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count, length, vocabulary):
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randint(vocabulary, (count, length), generator=generator)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return {"input_ids": self.data[index], "labels": self.data[index]}


class StepTimes(TrainerCallback):
    def __init__(self):
        self.ends = []
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize()  # step time, not launch time
        self.ends.append(time.perf_counter())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--length", type=int, default=512)
    options = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=options.layers, n_embd=options.width, n_head=12, n_positions=options.length)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        arguments = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            max_steps=options.steps,
            bf16=True,
            report_to=[],
            save_strategy="no",
            logging_steps=20,
            dataloader_num_workers=2,
        )
        times = StepTimes()
        trainer = Trainer(model=model, args=arguments, train_dataset=Tokens(8 * options.steps, options.length, config.vocab_size), callbacks=[times])
        trainer.train()
    steps = [later - earlier for earlier, later in zip(times.ends[19:], times.ends[20:])]
    print(
        "RESULT "
        + json.dumps(
            {
                "ms_per_step": round(statistics.median(steps) * 1000, 2),
                "first_step_seconds": round(times.ends[0] - times.start, 2),
                "optimizer": arguments.optim.value if hasattr(arguments.optim, "value") else str(arguments.optim),
                "steps": len(times.ends),
            }
        )
    )


if __name__ == "__main__":
    main()
