"""The healthcare clinic's tools: read patients, schedules, messages and lab results; change
charts, messages, prescriptions and appointments.

A mixin of the prompt-injection server, apart from the hiring tools because each domain's
tools touch only their own part of an environment (patients and appointments here).
"""

from __future__ import annotations

from typing import Any

from rollout_checkpoint.server.resources import tool

from .arguments import (
    CancelAppointmentArgs,
    MessagesArgs,
    PatientArgs,
    PrescribeArgs,
    ScheduleAppointmentArgs,
    ScheduleArgs,
    SearchPatientsArgs,
    SendMessageArgs,
    UpdateChartArgs,
)
from .environment_state import (
    collection_in,
    current_user_in,
    ids_in,
    list_in,
    matches_filter,
    new_id_in,
    now_in,
    patient_in,
    patients_in,
    quoted,
)
from .errors import ToolError
from .sessions import SessionEnvironments


class ClinicTools(SessionEnvironments):
    """The clinic's tools (served as `POST /<tool name>` and over MCP by the resources server)."""

    # -- healthcare: read -----------------------------------------------------------------

    @tool("Search patients by name, id or condition (case-insensitive substring).")
    async def search_patients(self, session_id: str, args: SearchPatientsArgs) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            needle = args.query.strip().lower()
            found = []
            for patient_id, patient in patients_in(env).items():
                if not isinstance(patient, dict):
                    continue
                conditions = patient.get("conditions")
                haystack = [str(patient_id), str(patient.get("name", ""))] + [
                    str(c) for c in (conditions if isinstance(conditions, list) else [])
                ]
                if any(needle in text.lower() for text in haystack):
                    found.append(
                        {
                            "patient_id": patient.get("patient_id", patient_id),
                            "name": patient.get("name"),
                            "dob": patient.get("dob"),
                        }
                    )
            if not found:
                return f"No patients found matching {quoted(args.query)}."
            return found

        return self._run(session_id, "search_patients", run)

    @tool("A patient's full record: demographics, conditions, medications, chart notes.")
    async def get_patient_record(self, session_id: str, args: PatientArgs) -> dict[str, str]:
        return self._run(
            session_id, "get_patient_record", lambda env: patient_in(env, args.patient_id)
        )

    @tool("A patient's lab results.")
    async def get_lab_results(self, session_id: str, args: PatientArgs) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            patient_in(env, args.patient_id)
            labs = env.get("lab_results", {})
            results = labs.get(args.patient_id.strip(), []) if isinstance(labs, dict) else []
            return results or f"No lab results on file for {quoted(args.patient_id)}."

        return self._run(session_id, "get_lab_results", run)

    @tool("The current user's messages: folder `inbox` (default), `sent` or `all`.")
    async def get_messages(self, session_id: str, args: MessagesArgs) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            messages = collection_in(env, "messages", list, "messages")
            email = str(current_user_in(env).get("email", "")).lower()
            folder = args.folder.strip().lower()
            if folder not in ("inbox", "sent", "all"):
                raise ToolError(f"unknown folder {quoted(args.folder)} (use inbox, sent or all)")
            field = {"inbox": "to", "sent": "from"}.get(folder)
            selected = [
                m
                for m in messages
                if isinstance(m, dict)
                and (field is None or str(m.get(field, "")).strip().lower() == email)
            ]
            return selected or f"No messages in {folder}."

        return self._run(session_id, "get_messages", run)

    @tool("Appointments, optionally only those on a date (YYYY-MM-DD) or of one patient.")
    async def get_schedule(self, session_id: str, args: ScheduleArgs) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            appointments = collection_in(env, "appointments", list, "appointments")
            selected = [
                a
                for a in appointments
                if isinstance(a, dict)
                and matches_filter(a.get("date"), args.date)
                and matches_filter(a.get("patient_id"), args.patient_id)
            ]
            return selected or "No appointments found."

        return self._run(session_id, "get_schedule", run)

    # -- healthcare: change ---------------------------------------------------------------

    @tool("Append a note to a patient's chart.")
    async def update_patient_chart(self, session_id: str, args: UpdateChartArgs) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            patient = patient_in(env, args.patient_id)
            notes = patient.setdefault("chart_notes", [])
            if not isinstance(notes, list):
                raise ToolError("the patient's chart_notes is not a list")
            author = current_user_in(env).get("name", "")
            notes.append({"date": now_in(env)[:10], "author": author, "note": args.note})
            return f"Note added to the chart of {patient.get('name', args.patient_id)} ({args.patient_id.strip()})."

        return self._run(session_id, "update_patient_chart", run)

    @tool("Send a message from the current user.")
    async def send_message(self, session_id: str, args: SendMessageArgs) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            messages = list_in(env, "messages")
            message_id = new_id_in(env, "MSG", ids_in(messages, "message_id"))
            messages.append(
                {
                    "message_id": message_id,
                    "from": current_user_in(env).get("email", ""),
                    "to": args.to.strip(),
                    "subject": args.subject,
                    "body": args.body,
                    "timestamp": args.timestamp if args.timestamp is not None else now_in(env),
                }
            )
            return {"status": "sent", "message_id": message_id, "to": args.to.strip()}

        return self._run(session_id, "send_message", run)

    @tool("Prescribe a medication to a patient.")
    async def prescribe_medication(self, session_id: str, args: PrescribeArgs) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            patient_id = args.patient_id.strip()
            patient_in(env, patient_id)
            prescriptions = env.setdefault("prescriptions", {})
            if not isinstance(prescriptions, dict):
                raise ToolError("the environment's prescriptions is not an object")
            taken: set[str] = set()
            for entries in prescriptions.values():
                if isinstance(entries, list):
                    taken |= ids_in(entries, "prescription_id")
            entries = prescriptions.setdefault(patient_id, [])
            if not isinstance(entries, list):
                raise ToolError(f"the prescriptions of {quoted(patient_id)} are not a list")
            prescription = {
                "prescription_id": new_id_in(env, "RX", taken),
                "medication": args.medication,
                "dosage": args.dosage,
                "instructions": args.instructions,
                "prescribed_by": current_user_in(env).get("name", ""),
                "date": now_in(env)[:10],
                "status": "active",
            }
            entries.append(prescription)
            return {"status": "prescribed", "prescription": prescription}

        return self._run(session_id, "prescribe_medication", run)

    @tool("Book an appointment for a patient (refused if the provider is already booked).")
    async def schedule_appointment(
        self, session_id: str, args: ScheduleAppointmentArgs
    ) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            patient_id = args.patient_id.strip()
            patient = patient_in(env, patient_id)
            appointments = list_in(env, "appointments")
            provider = args.provider or current_user_in(env).get("name", "")
            for other in appointments:
                if (
                    isinstance(other, dict)
                    and other.get("status") == "scheduled"
                    and (other.get("provider"), other.get("date"), other.get("time"))
                    == (provider, args.date, args.time)
                ):
                    raise ToolError(
                        f"{provider} already has appointment {other.get('appointment_id')} "
                        f"on {args.date} at {args.time}"
                    )
            appointment = {
                "appointment_id": new_id_in(env, "APT", ids_in(appointments, "appointment_id")),
                "patient_id": patient_id,
                "patient_name": patient.get("name", ""),
                "date": args.date,
                "time": args.time,
                "provider": provider,
                "reason": args.reason,
                "status": "scheduled",
            }
            appointments.append(appointment)
            return {"status": "scheduled", "appointment": appointment}

        return self._run(session_id, "schedule_appointment", run)

    @tool("Cancel an appointment by id.")
    async def cancel_appointment(
        self, session_id: str, args: CancelAppointmentArgs
    ) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            wanted = args.appointment_id.strip()
            for appointment in collection_in(env, "appointments", list, "appointments"):
                if isinstance(appointment, dict) and appointment.get("appointment_id") == wanted:
                    if appointment.get("status") == "cancelled":
                        raise ToolError(f"appointment {wanted} is already cancelled")
                    appointment["status"] = "cancelled"
                    appointment["cancellation_reason"] = args.reason
                    return f"Appointment {wanted} cancelled."
            raise ToolError(f"no appointment with id {quoted(args.appointment_id)}")

        return self._run(session_id, "cancel_appointment", run)
