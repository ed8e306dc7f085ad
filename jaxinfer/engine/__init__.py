"""The engine: the schedule -> step -> update loop, the scheduler and page allocator, outputs and `LLM`."""
