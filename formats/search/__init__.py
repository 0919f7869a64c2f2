"""The measure stage's search engine: the MIX and scale searches and their device tiers."""
