"""Models: list, create, get."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from weightsync import errors
from weightsync.service.deps import OpsDep, Publisher, Reader
from weightsync.service.schemas import CreateModelIn, ModelList, ModelOut, model_out

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", operation_id="listModels", response_model=ModelList)
async def list_models(ops: OpsDep, who: Reader) -> ModelList:
    """Every model the token may read, by name."""
    return ModelList(models=[model_out(m) for m in await ops.list_models() if who.may_use(m.name)])


@router.post(
    "",
    operation_id="createModel",
    status_code=status.HTTP_201_CREATED,
    response_model=ModelOut,
    responses={200: {"model": ModelOut, "description": "the model existed with these settings"}},
)
async def create_model(body: CreateModelIn, ops: OpsDep, who: Publisher, response: Response) -> ModelOut:
    """Create a model (201), or return it unchanged (200) if it exists with the same settings (else 409)."""
    who.require("publish", body.name)
    settings = body.model_dump(exclude_unset=True, exclude={"name"})
    # null means "default" for these two; for keep_last it means "keep all".
    settings = {k: v for k, v in settings.items() if v is not None or k == "keep_last"}
    try:
        await ops.get_model(body.name)
        existed = True
    except errors.ModelNotFound:
        existed = False
    model = await ops.create_model(body.name, **settings)
    if existed:
        response.status_code = status.HTTP_200_OK
    return model_out(model)


@router.get("/{model:model}", operation_id="getModel", response_model=ModelOut)
async def get_model(model: str, ops: OpsDep, who: Reader) -> ModelOut:
    """One model: its head and its chain and retention settings."""
    return model_out(await ops.get_model(model))
