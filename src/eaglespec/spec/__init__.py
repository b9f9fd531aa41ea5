"""The batched speculative step: tensor trees, drafting (propose), verification and the step that
ties them together. Everything here works on B rows at once and stays on the model's device;
nothing in the hot path walks nodes in Python or copies to the host per node."""
