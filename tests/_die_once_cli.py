"""``rlhf-fusion`` for tests/test_loop_restarts.py: on torchrun's first attempt the rank named
by ``DIE_RANK`` SIGKILLs itself in the training stage of iteration ``DIE_AT`` (as an OOM kill
or a lost node would end it), so torchrun restarts every rank. Kept out of the product."""

import os
import signal
import sys

from rlhf_fusion.cli import main
from rlhf_fusion.loop.iteration import PPOWorker

if (os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        and os.environ.get("RANK") == os.environ.get("DIE_RANK")):
    at = int(os.environ["DIE_AT"])
    train = PPOWorker.train

    def train_or_die(self, batch, iteration):   # noqa: ANN001, ANN202 - the patched method's
        if iteration == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return train(self, batch, iteration)

    PPOWorker.train = train_or_die

sys.exit(main())
