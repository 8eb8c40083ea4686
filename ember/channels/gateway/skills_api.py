"""Skills over HTTP, scoped like memory: the caller sees the shared skills and
their own learned ones, and decides their own pending proposals. Another
person's learned skill or proposal does not exist for a caller (404)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.channels.gateway.http import ApiError, read_json
from ember.channels.gateway.turns import CHANNEL
from ember.core.errors import SkillError, SkillNotFound
from ember.core.skills import ProposalStatus
from ember.memory.identity import Identities
from ember.skills.library import SkillLibrary


class SkillDecision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    decision: Literal["approve", "reject"] = Field(validation_alias=AliasChoices("decision", "action"))


class SkillsApi:
    def __init__(self, skills: SkillLibrary, identities: Identities, *, max_body_bytes: int) -> None:
        self._skills = skills
        self._identities = identities
        self._max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        return [
            Route("/api/skills", self.list_skills, methods=["GET"]),
            Route("/api/skills/pending", self.pending, methods=["GET"]),
            Route("/api/skills/pending/{id}", self.decide, methods=["POST"]),
            Route("/api/skills/{name}", self.skill, methods=["GET"]),
        ]

    def _person(self, request: Request) -> str:
        return self._identities.resolve(CHANNEL, request.state.identity)

    async def list_skills(self, request: Request) -> Response:
        skills = await self._skills.skills(self._person(request))
        return JSONResponse([skill.to_json_dict() for skill in skills])

    async def skill(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            skill, current, history = await self._skills.show(self._person(request), name)
        except SkillNotFound as exc:
            raise ApiError(404, str(exc), code="skill_not_found") from None
        return JSONResponse({**skill.to_json_dict(), "text": current.text, "files": sorted(current.files),
                             "history": [version.to_json_dict(with_text=False) for version in history]})

    async def pending(self, request: Request) -> Response:
        proposals = await self._skills.proposals(self._person(request), ProposalStatus.PENDING)
        return JSONResponse([proposal.to_json_dict() for proposal in proposals])

    async def decide(self, request: Request) -> Response:
        body = await read_json(request, SkillDecision, self._max_body_bytes)
        proposal_id, person = request.path_params["id"], self._person(request)
        try:
            decided = await self._skills.decide(proposal_id, body.decision == "approve", request.state.identity,
                                                identity=person)
        except SkillNotFound as exc:
            raise ApiError(404, str(exc), code="proposal_not_found") from None
        except SkillError as exc:  # decided already, or its text no longer parses
            raise ApiError(409, str(exc), code="proposal_decided") from None
        return JSONResponse(decided.to_json_dict())
