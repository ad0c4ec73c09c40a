"""The causal-LM fine-tuning script of tests/test_hf.py, written as transformers' documentation
writes it, in its plain and private versions, and the launch of its torchrun version, which
conftest runs in the background (``python tests/hf_trainer_script.py OUT``): 4 ranks as
dp = 2 x cp = 2 with ZeRO-3, then its checkpoint-3 resumed on 2 ranks (cp = 2). Not a test file:
test_hf.py imports it (no test file imports another)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import finetune_fixtures as ff

SCRIPT = '''\
import math
from datasets import load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)

tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
raw = load_dataset("text", data_files=DATA, sample_by="paragraph")["train"].train_test_split(test_size=0.2, seed=0)
tokenized = raw.map(lambda examples: tokenizer(examples["text"]), batched=True, remove_columns=["text"])
block_size = 32


def group_texts(examples):
    concatenated = {k: sum(examples[k], []) for k in examples.keys()}
    total_length = len(concatenated[list(examples.keys())[0]]) // block_size * block_size
    result = {k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}
    result["labels"] = result["input_ids"].copy()
    return result


lm_dataset = tokenized.map(group_texts, batched=True)
data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)
model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
training_args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3,
                                  weight_decay=0.01, logging_steps=2, eval_strategy="steps", eval_steps=3,
                                  save_steps=3, report_to="none", use_cpu=True)
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=lm_dataset["train"],
    eval_dataset=lm_dataset["test"],
    data_collator=data_collator,
    processing_class=tokenizer,
)
trainer.train()
eval_results = trainer.evaluate()
print(f"Perplexity: {math.exp(eval_results['eval_loss']):.2f}")
trainer.save_model(OUT + "/final")
'''

PRIVATE = (SCRIPT
           .replace("                          TrainingArguments)\n",
                    "                          TrainingArguments)\n"
                    "from longshield_fx.hf import DPTrainer, PrivacyArguments\n")
           .replace("trainer = Trainer(\n",
                    "trainer = DPTrainer(\n    privacy=PrivacyArguments(noise_multiplier=1.0, expected_batch_size=8, "
                    "insecure_seed=SEED),\n"))
SEED = 7

NOISELESS = PRIVATE.replace("noise_multiplier=1.0", "noise_multiplier=0.0")

# Each rank writes the names of its gloo threads at the script's end (gloo_threads/end-rank{r}) and
# at exit, after DPTrainer's exit handler joined them (exit-rank{r}): atexit runs the handler
# registered first last, and this one is registered before DPTrainer exists.
GLOO_THREADS = '''import atexit, os
from pathlib import Path


def comm(task):
    try:
        return task.joinpath("comm").read_text().strip()
    except FileNotFoundError:  # a thread that ended after the listing
        return ""


def gloo_threads(when):
    names = sorted(n for n in map(comm, Path("/proc/self/task").iterdir()) if "gloo" in n)
    folder = Path(os.environ["OUT"], "gloo_threads")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{when}-rank{os.environ['RANK']}").write_text("\\n".join(names))


atexit.register(gloo_threads, "exit")
'''

TORCHRUN = (GLOO_THREADS
            + "MODEL_DIR, DATA, OUT, SEED = os.environ['MODEL_DIR'], os.environ['DATA'], os.environ['OUT'], 7\n"
            + NOISELESS.replace("insecure_seed=SEED)", "insecure_seed=SEED, cp=2, fsdp=os.environ['FSDP'].split(','), "
                                "fork='RESUME' in os.environ)")
            .replace("trainer.train()", "trainer.train(resume_from_checkpoint=os.environ.get('RESUME'))")
            + 'gloo_threads("end")\n')


def folders(root: Path) -> tuple[str, str]:
    """(model dir, data file) under ``root``: a tiny Llama with its own BPE tokenizer, and the notes."""
    texts = ff.documents(40, seed=3)
    tok = ff.tokenizer(texts)
    model_dir = ff.save(ff.tiny_llama(len(tok)), tok, root / "model")
    data = root / "notes.txt"
    data.write_text("\n\n".join(t.strip() for t in texts) + "\n")
    return str(model_dir), str(data)


def torchrun(nproc: int, script: Path, log, **env) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1500, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env)).returncode


def main(out: Path) -> int:
    """The two launches: out/dp2cp2 (4 ranks) and out/cp2 (2 ranks, resumed from its checkpoint-3)."""
    model_dir, data = folders(out)
    script = out / "finetune_clm.py"
    script.write_text(TORCHRUN)
    runs = [(4, dict(OUT=str(out / "dp2cp2"), FSDP="dp,cp")),
            (2, dict(OUT=str(out / "cp2"), FSDP="cp", RESUME=str(out / "dp2cp2" / "checkpoint-3")))]
    for nproc, env in runs:
        rc = torchrun(nproc, script, sys.stdout, MODEL_DIR=model_dir, DATA=data, **env)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
