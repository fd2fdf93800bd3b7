"""``async_grpo_full_finetune_distributed`` with a broken weight flow: the rollout ranks take
every broadcast but load it into a throwaway copy, so they keep sampling with the base
weights. Run through torchrun like the recipe; the log-prob gap metric must expose it."""

import copy

from torchtune_grpo.training import async_transport

_receive = async_transport.WeightReceiver.receive


def _receive_into_a_copy(self, model):
    return _receive(self, copy.deepcopy(model))


async_transport.WeightReceiver.receive = _receive_into_a_copy

if __name__ == "__main__":
    from async_grpo_full_finetune_distributed import recipe_main

    recipe_main()
