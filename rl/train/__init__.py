"""The trainer: the policy and its optimizer, the RL maths, the train step over packed micro-batches, the push."""
