"""The plain HF Trainer run (trainer.py) with MTraining: three lines differ.

    deepspeed --num_gpus 2 examples/trainer_mtraining.py --deepspeed_config examples/ds_config_trainer.json --bf16
"""
import torch
from transformers import Trainer, TrainingArguments

import ds_mtraining.integration as mtraining

from common import RandomTokens, build_model, parse_args


def main(argv=None, dataset=None):
    args = parse_args(argv, __doc__)
    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed_config, per_device_train_batch_size=1,
        max_steps=args.steps, learning_rate=args.learning_rate, max_grad_norm=args.max_grad_norm,
        lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, seed=args.seed, logging_steps=1, bf16=args.bf16,
        save_strategy="no", report_to=[], train_sampling_strategy="sequential", use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True)
    model = build_model(args)
    mt = mtraining.enable(model, args.deepspeed_config)  # attention, groups (mpu), loss, hooks
    dataset = dataset or RandomTokens(args.seq_len, model.config.vocab_size, seed=args.seed)
    trainer = mt.adapt_trainer(Trainer(model=model, args=training_args, train_dataset=dataset))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "model": model}


if __name__ == "__main__":
    main()
