"""Models: list, create, get, change settings, delete, and pin the version followers hold."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from weightsync import errors
from weightsync.ops.admin import delete_model as run_delete_model
from weightsync.ops.admin import pin_model
from weightsync.service.deps import Admin, OpsDep, Publisher, Reader
from weightsync.service.schemas import (
    CreateModelIn,
    DeletedModelOut,
    ModelList,
    ModelOut,
    PinIn,
    UpdateModelIn,
    deleted_model_out,
    model_out,
)

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
    """One model: its head, its chain and retention settings, and its pin."""
    return model_out(await ops.get_model(model))


@router.patch("/{model:model}", operation_id="updateModel", response_model=ModelOut)
async def update_model(model: str, body: UpdateModelIn, ops: OpsDep, who: Publisher) -> ModelOut:
    """Change the settings given (keyframe_interval, max_chain_ratio, keep_last); the others stay."""
    return model_out(await ops.update_model_settings(model, **body.model_dump(exclude_unset=True)))


@router.delete("/{model:model}", operation_id="deleteModel", response_model=DeletedModelOut)
async def delete_model(model: str, ops: OpsDep, who: Admin) -> DeletedModelOut:
    """Delete the model: its versions (GC reclaims their objects after its grace period), pending
    publishes, leases and ledger. Its name is free again; a new model under it numbers on."""
    return deleted_model_out(await run_delete_model(ops, model))


@router.put("/{model:model}/pin", operation_id="pinModel", response_model=ModelOut)
async def pin(model: str, body: PinIn, ops: OpsDep, who: Publisher) -> ModelOut:
    """Make followers hold committed version ``version`` while the head moves on (404 if not committed)."""
    return model_out(await pin_model(ops, model, body.version))


@router.delete("/{model:model}/pin", operation_id="unpinModel", response_model=ModelOut)
async def unpin(model: str, ops: OpsDep, who: Publisher) -> ModelOut:
    """Make followers follow the head again."""
    return model_out(await pin_model(ops, model, None))
