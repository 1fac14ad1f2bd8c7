"""device telemetry read from outside the job (dcgm-exporter / Prometheus) and fleet utilisation

``run_devices.source``: where a window's figures came from — ``agent`` (the in-job agent's NVML telemetry,
every row before this revision) or ``dcgm`` (the server's reader of dcgm-exporter / Prometheus, joined to the
run's ranks on that node: server/dcgm.py). A plain column with a constant default: on Citus the distributed
table takes it as it is (run_id still leads the primary key).

Revision ID: 0024
Revises: 0023
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401

revision = '0024'
down_revision = '0023'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('run_devices', sa.Column('source', sa.String(length=16), nullable=False, server_default='agent'))


def downgrade() -> None:
    op.drop_column('run_devices', 'source')
