"""The recipe names (include/flowmoe/recipe.h's table; the native library lists the same:
flowmoe._native.recipe_names()). No import, so that scripts can read it without PyTorch."""

RECIPES = ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4")
