"""Speculative decoding: proposers that draft tokens (n-gram prompt lookup, a draft model, a DFlash block
drafter) and the host's choice of how many to draft. The target verifies them in one step of k + 1 query rows
a sequence (runner.steps.verify_step); the acceptance math is sampling.rejection."""
