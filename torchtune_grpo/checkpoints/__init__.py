"""Step folders: atomic saves, resume, what a folder must hold, the recipe state, and one run per
output folder."""
