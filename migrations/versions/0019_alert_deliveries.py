"""alert deliveries: what each sink (Slack, the webhook, Alertmanager) was last told about each alert

One row per (alert, sink): ``seq`` is the last transition of the alert the sink was told (3 × the
alert's reopen count + 0 fired / 1 acknowledged / 2 resolved), ``state`` the alert state it was told,
``told_at`` when (Alertmanager's re-sends are due from it). ``attempts`` / ``next_at``: failed
deliveries since the last success and when the next try is due. ``claimed_by`` / ``claimed_until``: the
server instance delivering it now (a lease), so two instances never deliver one transition twice.
Every instance computes what is due from this table and ``alerts`` (server/store/alert_deliveries.py),
so nothing is lost at a restart. A reference table on Citus, like ``alerts`` (no run id).

Existing alerts are seeded as told (their current state, ``told_at`` NULL): an upgrade announces
nothing again, and Alertmanager gets the firing ones re-posted at once.

Revision ID: 0019
Revises: 0018
"""
import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'alert_deliveries',
        sa.Column('alert_id', sa.Integer(), nullable=False),
        sa.Column('sink', sa.String(length=16), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=True),
        sa.Column('state', sa.String(length=16), nullable=True),
        sa.Column('told_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
        sa.Column('next_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('claimed_by', sa.String(length=64), nullable=True),
        sa.Column('claimed_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('alert_id', 'sink', name=op.f('pk_alert_deliveries')),
    )
    op.execute(
        "INSERT INTO alert_deliveries (alert_id, sink, seq, state) "
        "SELECT a.id, s.sink, CASE a.state WHEN 'firing' THEN 0 WHEN 'acknowledged' THEN 1 ELSE 2 END, a.state "
        "FROM alerts a CROSS JOIN (VALUES ('slack'), ('webhook'), ('alertmanager')) AS s(sink)"
    )


def downgrade() -> None:
    op.drop_table('alert_deliveries')
