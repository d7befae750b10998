"""Training: optimiser steps over megatron-core models (and, later, the Engine and trainer templates)."""
