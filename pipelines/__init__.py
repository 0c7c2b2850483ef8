"""Sources, pre/post-processing, batching and scheduling. Imports engines/, never agent/."""
