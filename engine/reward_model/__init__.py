"""Reward models: a Hugging Face sequence classifier scoring (prompt, response), in the driver
process (``task.reward_model.placement=colocated``) or in a separate Ray actor (``actor``)."""
