"""The plain DeepSpeed loop (deepspeed_loop.py) with MTraining: three lines differ.

    deepspeed --num_gpus 2 examples/deepspeed_loop_mtraining.py --deepspeed_config examples/ds_config.json
"""
import time

import deepspeed
import ds_mtraining.integration as mtraining
from torch.utils.data import DataLoader, DistributedSampler

from common import RandomTokens, build_model, parse_args, report


def main(argv=None, dataset=None):
    args = parse_args(argv, __doc__)
    model = build_model(args)
    mt = mtraining.enable(model, args.deepspeed_config)  # attention, groups (mpu), loss, hooks
    engine, *_ = deepspeed.initialize(model=model, config=args.deepspeed_config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    dataset = dataset or RandomTokens(args.seq_len, model.config.vocab_size, seed=args.seed)
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = mt.loader(DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler))
    tokens = args.seq_len * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size
    losses = []
    for step, batch in zip(range(args.steps), loader):
        started = time.perf_counter()
        loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss
        engine.backward(loss)
        engine.step()
        losses.append(report(step, loss, tokens, started))
    return {"losses": losses, "model": model}


if __name__ == "__main__":
    main()
