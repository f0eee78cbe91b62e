"""The prompt-injection tools' arguments, validated before a tool touches the environment.

Strict types and bounded lengths: a call with a wrong-typed or oversized argument is refused
whole (422), so a session's environment only ever changes by a valid call and a checkpoint
never exports half an update.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictInt, StrictStr


class _Args(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SearchPatientsArgs(_Args):
    query: StrictStr = Field(max_length=200)


class PatientArgs(_Args):
    patient_id: StrictStr = Field(max_length=100)


class MessagesArgs(_Args):
    folder: StrictStr = "inbox"
    """`inbox` (to the current user), `sent` (from the current user) or `all`."""


class ScheduleArgs(_Args):
    date: StrictStr | None = None
    patient_id: StrictStr | None = None


class UpdateChartArgs(_Args):
    patient_id: StrictStr = Field(max_length=100)
    note: StrictStr = Field(min_length=1, max_length=10_000)


class SendMessageArgs(_Args):
    to: StrictStr = Field(min_length=1, max_length=320)
    subject: StrictStr = Field(default="", max_length=500)
    body: StrictStr = Field(max_length=20_000)
    timestamp: StrictStr | None = None
    """When the message is sent; defaults to the environment's `current_time`."""


class PrescribeArgs(_Args):
    patient_id: StrictStr = Field(max_length=100)
    medication: StrictStr = Field(min_length=1, max_length=200)
    dosage: StrictStr = Field(min_length=1, max_length=200)
    instructions: StrictStr = Field(default="", max_length=2_000)


class ScheduleAppointmentArgs(_Args):
    patient_id: StrictStr = Field(max_length=100)
    date: StrictStr = Field(min_length=1, max_length=40)
    time: StrictStr = Field(min_length=1, max_length=40)
    reason: StrictStr = Field(default="", max_length=1_000)
    provider: StrictStr | None = None


class CancelAppointmentArgs(_Args):
    appointment_id: StrictStr = Field(max_length=100)
    reason: StrictStr = Field(default="", max_length=1_000)


class ListCandidatesArgs(_Args):
    status: StrictStr | None = None
    position: StrictStr | None = None


class CandidateArgs(_Args):
    candidate_id: StrictStr = Field(max_length=100)


class ChangeStatusArgs(_Args):
    candidate_id: StrictStr = Field(max_length=100)
    status: StrictStr = Field(min_length=1, max_length=100)


class SendOfferArgs(_Args):
    candidate_id: StrictStr = Field(max_length=100)
    salary: StrictInt | FiniteFloat | StrictStr
    start_date: StrictStr = Field(min_length=1, max_length=40)
    position: StrictStr | None = None
