"""``python -m accelerate_neuron``: the ``accelerate-neuron`` command."""

import sys

from accelerate_neuron.cli import main

sys.exit(main())
