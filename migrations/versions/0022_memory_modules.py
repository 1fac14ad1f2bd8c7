"""memory per module and checkpointing advice (issue: Plan before spending GPUs)

Reserved revision: filled in by the change that needs it (a no-op until then).

Revision ID: 0022
Revises: 0021
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401

revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
