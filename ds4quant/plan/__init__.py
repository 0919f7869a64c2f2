"""The planner: recipes, the adaptive measure stage, the cache, the allocation and the plan summary."""
