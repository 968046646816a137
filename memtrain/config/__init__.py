"""Recipe schema and loading: ``load_recipe(path, overrides) -> RunConfig``."""

from memtrain.config.loader import (
    RecipeError,
    dump_recipe,
    load_recipe,
    resolve_recipe_path,
    shipped_recipes_dir,
)
from memtrain.config.schema import (
    AdapterConfig,
    DataConfig,
    DistributedConfig,
    FewBitConfig,
    MemoryConfig,
    ModelConfig,
    OffloadConfig,
    OutputConfig,
    Problem,
    RandomizedLinearConfig,
    RunConfig,
    TrainingConfig,
)

__all__ = [
    "AdapterConfig",
    "DataConfig",
    "DistributedConfig",
    "FewBitConfig",
    "MemoryConfig",
    "ModelConfig",
    "OffloadConfig",
    "OutputConfig",
    "Problem",
    "RandomizedLinearConfig",
    "RecipeError",
    "RunConfig",
    "TrainingConfig",
    "dump_recipe",
    "load_recipe",
    "resolve_recipe_path",
    "shipped_recipes_dir",
]
